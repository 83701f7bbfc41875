"""The running pipeline: stage processes on nodes (``stage_process``, ``senders``, ``emulate``), the
coordinator's membership and mail (``roster``, ``mail``, ``codec``: the data-only wire, ``door``: the
open join), the model's state (``weights``, ``checkpoint_file``, ``recovery``), and what a run shows
while it goes (``control``, ``slowness``)."""
