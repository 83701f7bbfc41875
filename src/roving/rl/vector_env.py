"""RovingVectorEnv: gymnasium's ``AsyncVectorEnv``, with each environment in a roving process.

``RovingVectorEnv([lambda: gym.make("CartPole-v1")] * 8)`` behaves like
``gymnasium.vector.AsyncVectorEnv`` of the same functions: ``reset(seed=, options=)``,
``step(actions) -> (obs, rewards, terminations, truncations, infos)`` with batched arrays and
vectorised info dicts, ``step_async``/``step_wait``, ``call``, ``get_attr``, ``set_attr``, ``close``,
``num_envs``, ``single_observation_space``/``single_action_space`` and their batched forms. Autoreset is
gymnasium's default, ``NEXT_STEP``: the ``step`` after an episode ends resets that environment (its action
is ignored) and returns the first observation with reward 0 and both flags false.

Each environment is built by its function inside a :class:`roving.Process` (on whatever backend roving is
configured for) and talks to the parent over a :func:`roving.Pipe`. Guarantees:

* An exception raised by an environment is raised by the call that caused it, in the parent, and the
  vector env is then closed: its state is no longer consistent.
* A worker that dies makes the waiting call raise ``EOFError`` naming the environment; nothing is retried
  (an environment's state cannot be recovered).
* Every wait takes ``timeout`` seconds at most (``None``: forever); past it ``multiprocessing.TimeoutError``.
* ``close()`` ends every worker, also after an error, and is idempotent; a vector env that is garbage
  collected unclosed has its workers killed.
"""
from __future__ import annotations

import copy as _copy
import logging
import traceback
from multiprocessing import TimeoutError
from typing import Any, Callable, Dict, List, Optional, Sequence, SupportsFloat, Tuple, Union

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space, concatenate, create_empty_array, iterate

from ..connection import Pipe
from ..process import Process

__all__ = ["RovingVectorEnv"]

log = logging.getLogger(__name__)


def _serve(env_fn: Callable[[], gym.Env], conn: Any) -> None:
    """The worker: build the environment, report its spaces, then answer commands until ``close``."""
    env = env_fn()
    conn.send(("ok", (env.observation_space, env.action_space, env.metadata, env.render_mode, env.spec)))
    needs_reset = False
    try:
        while True:
            cmd, data = conn.recv()
            try:
                if cmd == "reset":
                    obs, info = env.reset(seed=data[0], options=data[1])
                    needs_reset = False
                    reply: Any = (obs, info)
                elif cmd == "step":
                    if needs_reset:
                        obs, info = env.reset()
                        reward: SupportsFloat = 0.0
                        terminated, truncated = False, False
                    else:
                        obs, reward, terminated, truncated, info = env.step(data)
                    needs_reset = bool(terminated or truncated)
                    reply = (obs, reward, terminated, truncated, info)
                elif cmd == "call":
                    name, args, kwargs = data
                    attr = getattr(env, name)
                    reply = attr(*args, **kwargs) if callable(attr) else attr
                elif cmd == "set_attr":
                    setattr(env, data[0], data[1])
                    reply = None
                elif cmd == "close":
                    conn.send(("ok", None))
                    return
                else:
                    raise ValueError(f"unknown command {cmd!r}")
                conn.send(("ok", reply))
            except Exception as exc:  # the parent raises it; the worker waits for close
                conn.send(("error", (exc, traceback.format_exc())))
    finally:
        env.close()


class RovingVectorEnv(VectorEnv):
    """A vector of environments, each in a roving process; the interface of ``AsyncVectorEnv``."""

    def __init__(self, env_fns: Sequence[Callable[[], gym.Env]], copy: bool = True,
                 timeout: Optional[float] = 60.0) -> None:
        if not env_fns:
            raise ValueError("RovingVectorEnv needs at least one environment function")
        self.num_envs = len(env_fns)
        self.copy, self.timeout = copy, timeout
        self.closed = False
        self._conns: List[Any] = []
        self._procs: List[Process] = []
        self._waiting = False
        try:
            for i, fn in enumerate(env_fns):
                parent, child = Pipe()
                proc = Process(target=_serve, args=(fn, child), name=f"RovingVectorEnv-{i}", daemon=True)
                proc.start()
                child.close()
                self._conns.append(parent)
                self._procs.append(proc)
            described = self._receive_all()
        except BaseException:
            self.close_extras(terminate=True)
            raise
        obs_space, act_space, metadata, render_mode, spec = described[0]
        for i, (o, a, *_) in enumerate(described[1:], 1):
            if o != obs_space or a != act_space:
                self.close_extras(terminate=True)
                raise ValueError(f"environment {i} has spaces {o}, {a}; environment 0 has {obs_space}, "
                                 f"{act_space}: every environment of a vector env must have the same spaces")
        self.single_observation_space, self.single_action_space = obs_space, act_space
        self.observation_space = batch_space(obs_space, self.num_envs)
        self.action_space = batch_space(act_space, self.num_envs)
        self.metadata = dict(metadata or {}, autoreset_mode=AutoresetMode.NEXT_STEP)
        self.render_mode, self.spec = render_mode, spec
        self._obs: Any = create_empty_array(obs_space, n=self.num_envs, fn=np.zeros)

    # -- the VectorEnv interface --------------------------------------------------------------
    def reset(self, *, seed: Union[int, Sequence[Optional[int]], None] = None,
              options: Optional[dict] = None) -> Tuple[Any, Dict[str, Any]]:
        """Reset every environment: an int seed gives environment i the seed ``seed + i``."""
        if seed is None or isinstance(seed, int):
            seeds = [None if seed is None else seed + i for i in range(self.num_envs)]
        else:
            seeds = list(seed)
            if len(seeds) != self.num_envs:
                raise ValueError(f"{len(seeds)} seeds for {self.num_envs} environments")
        self._send_all([("reset", (s, options)) for s in seeds])
        results = self._receive_all()
        infos: dict = {}
        for i, (_, info) in enumerate(results):
            infos = self._add_info(infos, info, i)
        return self._batch_obs([obs for obs, _ in results]), infos

    def step(self, actions: object) -> Tuple[Any, np.ndarray, np.ndarray, np.ndarray, Dict[str, Any]]:
        self.step_async(actions)
        return self.step_wait()

    def step_async(self, actions: object) -> None:
        """Send the actions; :meth:`step_wait` collects the results."""
        self._send_all([("step", a) for a in iterate(self.action_space, actions)])
        self._waiting = True

    def step_wait(self,
                  timeout: Optional[float] = None) -> Tuple[Any, np.ndarray, np.ndarray, np.ndarray, Dict[str, Any]]:
        if not self._waiting:
            raise RuntimeError("step_wait() called without step_async()")
        results = self._receive_all(timeout)
        self._waiting = False
        infos: dict = {}
        for i, (*_, info) in enumerate(results):
            infos = self._add_info(infos, info, i)
        return (self._batch_obs([r[0] for r in results]),
                np.array([r[1] for r in results], dtype=np.float64),
                np.array([r[2] for r in results], dtype=np.bool_),
                np.array([r[3] for r in results], dtype=np.bool_), infos)

    def call(self, name: str, *args: object, **kwargs: object) -> tuple:
        """``getattr(env, name)(*args, **kwargs)`` in every environment (or the attribute's value)."""
        self._send_all([("call", (name, args, kwargs))] * self.num_envs)
        return tuple(self._receive_all())

    def get_attr(self, name: str) -> tuple:
        return self.call(name)

    def set_attr(self, name: str, values: object) -> None:
        """Set ``name`` in every environment: one value for all, or a list or tuple of one per env."""
        each = list(values) if isinstance(values, (list, tuple)) else [values] * self.num_envs
        if len(each) != self.num_envs:
            raise ValueError(f"{len(each)} values for {self.num_envs} environments")
        self._send_all([("set_attr", (name, v)) for v in each])
        self._receive_all()

    def render(self) -> tuple:
        """Every environment's ``render()``, in order."""
        return self.call("render")

    def close_extras(self, timeout: Optional[float] = None, terminate: bool = False) -> None:
        """Ask every worker to close its environment and exit; kill those that do not within 5 s."""
        if not terminate:
            for conn in self._conns:
                try:
                    conn.send(("close", None))
                except Exception:
                    terminate = True
        for proc in self._procs:
            if not terminate:
                proc.join(5 if timeout is None else timeout)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in self._conns:
            conn.close()
        self._conns, self._procs = [], []

    def __del__(self) -> None:
        if not getattr(self, "closed", True):
            try:
                self.close(terminate=True)
            except Exception:
                pass

    # -- internals ---------------------------------------------------------------------------
    def _batch_obs(self, observations: List[Any]) -> Any:
        self._obs = concatenate(self.single_observation_space, observations, self._obs)
        return _copy.deepcopy(self._obs) if self.copy else self._obs

    def _send_all(self, messages: List[Any]) -> None:
        if self.closed:
            raise RuntimeError("this RovingVectorEnv is closed")
        if self._waiting:
            raise RuntimeError("a step_async() is waiting for step_wait()")
        for conn, message in zip(self._conns, messages):
            conn.send(message)

    def _receive_all(self, timeout: Optional[float] = None) -> List[Any]:
        timeout = self.timeout if timeout is None else timeout
        replies, error = [], None
        for i, conn in enumerate(self._conns):
            if not conn.poll(timeout):
                self._fail()
                raise TimeoutError(f"environment {i} did not answer within {timeout} s")
            try:
                status, value = conn.recv()
            except EOFError:
                self._fail()
                raise EOFError(f"the process of environment {i} ended (exit code "
                               f"{self._procs[i].exitcode}); this vector env is closed") from None
            if status == "error" and error is None:
                error = (i, value)
            replies.append(value)
        if error is not None:
            i, (exc, text) = error
            self._fail()
            log.debug("environment %d raised:\n%s", i, text)
            raise exc
        return replies

    def _fail(self) -> None:
        self._waiting = False
        self.close_extras(terminate=True)
        self.closed = True
