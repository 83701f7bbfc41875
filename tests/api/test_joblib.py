"""The "roving" joblib backend against joblib's default (loky): the same results from Parallel (lists,
generators, errors), n_jobs as the number of workers, pending batches cancelled when one fails, and a
scikit-learn grid search with the same best parameters and scores, also when a worker is killed in the
middle of it. On the local backend and on the real single-node Slurm."""
from __future__ import annotations

import os

import joblib
import pytest
from joblib import Parallel, delayed

import helpers_futures as fx
import roving
import roving.joblib
from helpers_backends import require
from helpers_core import TIMEOUT


@pytest.fixture(params=["local", "slurm"])
def backend(request):
    require(request.param)
    roving.init(backend=request.param)
    yield request.param
    roving.joblib.shutdown()


def test_parallel_on_roving_gives_what_joblibs_default_gives(backend):
    expected = Parallel(n_jobs=4)(delayed(fx.add)(i, b=i) for i in range(300))
    with joblib.parallel_config(backend="roving"):
        got = Parallel(n_jobs=4)(delayed(fx.add)(i, b=i) for i in range(300))
    assert got == expected == [2 * i for i in range(300)]
    with joblib.parallel_backend("roving", n_jobs=2):  # the older spelling
        assert Parallel()(delayed(fx.square)(i) for i in range(5)) == [0, 1, 4, 9, 16]


def test_return_as_generator_yields_in_order_and_unordered_yields_each_once(backend):
    with joblib.parallel_config(backend="roving", n_jobs=3):
        gen = Parallel(return_as="generator")(delayed(fx.square)(i) for i in range(50))
        assert not isinstance(gen, list)
        assert list(gen) == [i * i for i in range(50)]
        unordered = Parallel(return_as="generator_unordered")(
            delayed(fx.sleep_then_return)(0.01 * (i % 4), i) for i in range(40))
        assert sorted(unordered) == list(range(40))


def test_n_jobs_is_the_number_of_workers_running_at_once(backend):
    barrier = roving.Barrier(3)
    with joblib.parallel_config(backend="roving", n_jobs=3):
        pids = Parallel(batch_size=1)(delayed(fx.meet)(barrier, TIMEOUT) for _ in range(3))
    assert len(set(pids)) == 3  # three calls met at a barrier of three: three workers at once
    assert os.getpid() not in pids


def test_n_jobs_1_runs_in_this_process_as_joblibs_backends_do(backend):
    with joblib.parallel_config(backend="roving", n_jobs=1):
        assert Parallel()(delayed(fx.getpid)() for _ in range(3)) == [os.getpid()] * 3


def test_a_failing_batch_raises_its_error_and_the_pending_batches_are_cancelled(backend, tmp_path):
    log = tmp_path / "calls.log"
    n = 200
    with joblib.parallel_config(backend="roving", n_jobs=2):
        Parallel()(delayed(fx.square)(i) for i in range(4))  # workers up
        with pytest.raises(ValueError, match="bad item") as info:
            Parallel(batch_size=1, pre_dispatch="all")(
                delayed(fx.logged_or_fail)(str(log), i) for i in range(n))
        assert "fail_on_bad" in str(info.value.__cause__)  # the remote traceback
        ran = len(log.read_text().splitlines())
        assert ran < n / 2, ran  # most batches never ran: they were cancelled
        # the backend is ready for the next call
        assert Parallel()(delayed(fx.square)(i) for i in range(6)) == [0, 1, 4, 9, 16, 25]


def _grid_search(n_jobs, estimator):
    """Best parameters, mean test scores and best score of a grid search of ``estimator`` over C."""
    from sklearn.datasets import make_classification
    from sklearn.model_selection import GridSearchCV

    X, y = make_classification(n_samples=300, n_features=10, n_informative=4, random_state=0)
    search = GridSearchCV(estimator, {"C": [0.001, 0.01, 0.1, 1.0, 10.0, 100.0]}, cv=4, n_jobs=n_jobs)
    search.fit(X, y)
    return search.best_params_, list(search.cv_results_["mean_test_score"]), search.best_score_


def test_grid_search_gives_the_same_best_parameters_and_scores_as_with_loky(backend, tmp_path):
    from helpers_joblib import KillOnceClassifier

    with joblib.parallel_config(backend="loky"):
        expected = _grid_search(4, KillOnceClassifier())
    with joblib.parallel_config(backend="roving"):
        got = _grid_search(4, KillOnceClassifier())
    assert got == expected
    # again, with a worker killed while it fits one of the candidates
    marker = tmp_path / "killed"
    with joblib.parallel_config(backend="roving"):
        got = _grid_search(4, KillOnceClassifier(marker=str(marker), kill_at_c=1.0))
    assert marker.exists()  # a worker was killed
    assert got[0] == expected[0] and got[1:] == expected[1:]


def test_unknown_backend_options_are_an_error_naming_them():
    with pytest.raises(ValueError, match="max_nbites"):
        with joblib.parallel_config(backend="roving", max_nbites=3):
            pass
