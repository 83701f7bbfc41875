"""Planning a SkipPipe run, with nothing but the standard library: the network (``network``), the cost
model (``costs``), the plan's types (``plan``), the search (``allocate``, ``routes``, ``planner``,
``background``), the baselines it is judged against (``baselines``, ``dtfm``) and the discrete-event
simulator that judges every plan (``simulate``). The package's public names are re-exported by
``roving.pipeline``."""
