"""The pipeline's errors a user can meet: each message says what was wrong and what to do.

``PipelineError`` is their base. It is a ValueError, so code that caught bad input with
``except ValueError`` before these classes existed keeps working.
"""

from __future__ import annotations


class PipelineError(ValueError):
    """Bad input to the pipeline (a plan, a run, a corpus, a checkpoint); the message says why."""


class PlanError(PipelineError):
    """Input that no plan or run can be made from; the message says what is wrong and what to do."""
