"""roving's system helpers, below every layer that uses them: owner-only files and folders
(:mod:`.private`: the backends' secret files, the crash log, checkpoints, code shipping, the pipeline's
control folder) and one thread that waits on many readable files (:mod:`.selector_thread`: the sentinel
watcher, the output pump). They import nothing of roving but its error family."""
