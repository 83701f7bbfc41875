"""Every error the pipeline raises, in one module with one base: ``PipelineError``.

Two families under it, by what the caller should do:

* **Bad input** (``PlanError``, ``DataError``, ``InferenceError``, ``CheckpointFileError``): a plan, a
  run, a corpus, a checkpoint or a setting that nothing can be made from; the message says what was
  wrong and what to do. Each is also a ``ValueError``, so code that caught bad input with ``except
  ValueError`` before these classes existed keeps working; the commands print them and exit with 2.
* **A run that cannot go on** (``NodeFailed``, ``NoMessage``, ``ExportRejected``) and the signals between the training
  coordinator's parts (``NodesLost``, ``RoundStalled``, ``ProtocolError``): raised while training runs.
  ``NodeFailed`` and ``ProtocolError`` are also ``RuntimeError``.

Every "must be at least 1" check of the pipeline's input raises ``PlanError`` (the model's sizes
included, in ``costs.ModelSpec`` and ``model.LlamaConfig`` alike).
"""

from __future__ import annotations

from ..errors import RovingError


class PipelineError(RovingError):
    """The base of every error the pipeline raises."""


# -- bad input ---------------------------------------------------------------------------------
class PlanError(PipelineError, ValueError):
    """Input that no plan or run can be made from; the message says what is wrong and what to do."""


class CheckpointFileError(PlanError):
    """A checkpoint file that cannot be read, that holds a type a checkpoint may not hold, or that is
    not a checkpoint the caller can use (a PlanError, so the commands print it as bad input)."""


class DataError(PipelineError, ValueError):
    """A corpus that cannot feed the training run; the message says what to do."""


class InferenceError(PipelineError, ValueError):
    """A checkpoint, drop choice or generation setting that cannot be used; the message says why."""


# -- a run that cannot go on, and the coordinator's signals ---------------------------------------
class NodeFailed(PipelineError, RuntimeError):
    """Training cannot go on: a stage process raised (the message carries its traceback), or failures
    left no process to hold stage 0, or an iteration failed ``max_retries`` times."""


class NoMessage(NodeFailed):
    """Nothing came from the stage processes in time."""


class ExportRejected(NodeFailed):
    """No replica of a stage exported weights that check out (``verify.Verifier.exported``): every one
    that was asked was caught exporting other weights than it reported holding. Raised instead of
    snapshotting, checkpointing or evaluating weights that were not checked."""


class NodesLost(PipelineError):
    """Stage processes were declared dead (their process exited, or their heartbeats stopped);
    ``names``: name -> why. Raised by ``roster.Roster`` and handled by the trainer (it re-plans)."""

    def __init__(self, names: dict[str, str], caught: dict[str, str] | None = None) -> None:
        super().__init__(", ".join(f"{n} ({why})" for n, why in sorted(names.items())))
        self.names = names
        #: those of ``names`` that verification caught (``verify``): excluded for good, not only lost
        self.caught = dict(caught or {})


class RoundStalled(PipelineError):
    """A round went ``stall_after`` seconds without a message while its nodes lived: one was lost.
    Raised and handled inside the trainer (the round is run again)."""


class Malformed(PipelineError, ValueError):
    """A message that does not fit the pipeline's data-only wire (``codec``): what was wrong, in words.
    Raised by ``codec.decode``; the inbox that read it refuses it and counts it against its writer."""


class JoinError(PipelineError, ConnectionError):
    """Joining a training through its open door failed (``door``): the address tried and why (not
    reached, not the training the invitation names, the invitation refused)."""


class CoordinatorLost(PipelineError, ConnectionError):
    """A node's coordinator stopped answering (its process ended, or it cannot be reached) for longer
    than the node waits (``StageSettings.coordinator_timeout``): the node left. Names the address."""


class ProtocolError(PipelineError, RuntimeError):
    """A message that its receiver does not handle (a wrong type, or not a protocol message at all)."""
