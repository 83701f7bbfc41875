"""An estimator for tests/api/test_joblib.py that workers import by reference: logistic regression that
kills the worker fitting it, once, when asked to (to lose a worker in the middle of a grid search)."""
from __future__ import annotations

from sklearn.base import BaseEstimator, ClassifierMixin
from sklearn.linear_model import LogisticRegression

import helpers_futures as fx


class KillOnceClassifier(ClassifierMixin, BaseEstimator):
    """``LogisticRegression(C)``; with ``marker`` set, the first fit of ``C == kill_at_c`` in any worker
    kills that worker (the marker file records that it happened)."""

    def __init__(self, C=1.0, marker=None, kill_at_c=None):
        self.C = C
        self.marker = marker
        self.kill_at_c = kill_at_c

    def fit(self, X, y):
        if self.marker is not None and self.C == self.kill_at_c:
            fx.kill_once(self.marker, None)
        self.model_ = LogisticRegression(C=self.C, max_iter=500).fit(X, y)
        self.classes_ = self.model_.classes_
        return self

    def predict(self, X):
        return self.model_.predict(X)
