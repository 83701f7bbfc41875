"""Nodes, regions and the links between them; presets from measured cloud networks."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any, Iterable

from .costs import PAPER_SECONDS_PER_SAMPLE_LAYER, ModelSpec, microbatches_in_flight
from ..errors import PlanError

log = logging.getLogger(__name__)

GIB = float(2**30)
#: bytes per second for one unit of each bandwidth unit a network file may use.
BANDWIDTH_UNITS = {"GiB/s": GIB, "GB/s": 1e9, "Gbit/s": 1e9 / 8, "Gbps": 1e9 / 8, "MiB/s": 2.0**20}
PRESETS = ("gcp12", "aws10")
#: microbatches in flight per node when a node's memory is given as a count (``Node.memory``).
DEFAULT_MEMORY = 8


@dataclass(frozen=True)
class Link:
    """A directed connection: latency in seconds, bandwidth in bytes per second."""

    latency_s: float
    bandwidth_bps: float


#: Inside one region the paper's scheduler assumed 1 ms and 2 GiB/s.
INTRA_REGION_LINK = Link(latency_s=0.001, bandwidth_bps=2 * GIB)


@dataclass(frozen=True)
class Node:
    """A machine that holds one stage: its region, compute speed and memory.

    Memory is given one of two ways: ``memory_mb``, the device memory in MiB, from which the cost model
    derives how many microbatches the node can hold in flight for the stage it holds (see
    ``costs.stage_memory``); or, when ``memory_mb`` is None, ``memory``, a fixed count of microbatches
    in flight whatever the stage (the SkipPipe paper's way of stating memory)."""

    name: str
    region: str
    #: seconds per sample per layer (forward); larger is slower.
    speed: float = PAPER_SECONDS_PER_SAMPLE_LAYER
    #: microbatches it can hold in flight (from its forward until its backward is done); used only
    #: when ``memory_mb`` is None.
    memory: int = DEFAULT_MEMORY
    #: device memory in MiB (2^20 bytes); when set, it decides and ``memory`` is ignored.
    memory_mb: float | None = None

    def in_flight(self, stage: int, model: ModelSpec, stages: int) -> int:
        """Microbatches this node can hold in flight while it holds ``stage`` (0: it cannot hold it)."""
        if self.memory_mb is None:
            return self.memory
        return microbatches_in_flight(self.memory_mb, stage, model, stages)

    def can_hold(self, stage: int, model: ModelSpec, stages: int) -> bool:
        return self.in_flight(stage, model, stages) >= 1


@dataclass
class Network:
    """Nodes plus region-to-region links. Links are symmetric unless both directions are given."""

    nodes: list[Node]
    links: dict[tuple[str, str], Link]
    intra: Link = INTRA_REGION_LINK
    name: str = "custom"
    _by_name: dict[str, Node] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self._by_name = {n.name: n for n in self.nodes}
        if len(self._by_name) != len(self.nodes):
            raise PlanError("node names must be unique")
        for n in self.nodes:
            if not n.speed > 0:
                raise PlanError(f"node {n.name}: speed (s/sample/layer) must be > 0, got {n.speed}")
            if n.memory_mb is not None:
                if not n.memory_mb > 0:
                    raise PlanError(f"node {n.name}: memory of {n.memory_mb:g} MB is too small for any plan; "
                                    "give each node's device memory in MB (raise --memory)")
            elif n.memory < 1:
                raise PlanError(
                    f"node {n.name}: memory of {n.memory} microbatches is too small for any plan; "
                    "every node must hold at least 1 microbatch in flight (raise --memory-microbatches)"
                )
        regions = sorted({n.region for n in self.nodes})
        missing = [
            (a, b) for i, a in enumerate(regions) for b in regions[i + 1 :]
            if (a, b) not in self.links and (b, a) not in self.links
        ]
        if missing:
            shown = ", ".join(f"{a}-{b}" for a, b in missing[:5])
            raise PlanError(
                f"network {self.name}: no link between regions {shown}"
                f"{' and more' if len(missing) > 5 else ''}; add them to the network file"
            )

    def node(self, name: str) -> Node:
        try:
            return self._by_name[name]
        except KeyError:
            raise PlanError(f"no node named {name!r} in the network") from None

    @property
    def names(self) -> list[str]:
        return [n.name for n in self.nodes]

    def link(self, a: str, b: str) -> Link:
        ra, rb = self._by_name[a].region, self._by_name[b].region
        if ra == rb:
            return self.intra
        found = self.links.get((ra, rb)) or self.links.get((rb, ra))
        assert found is not None  # checked in __post_init__
        return found

    def without(self, failed: Iterable[str]) -> "Network":
        gone = set(failed)
        for f in gone:
            self.node(f)
        return Network([n for n in self.nodes if n.name not in gone], self.links, self.intra, self.name)

    def with_nodes(self, nodes: list[Node]) -> "Network":
        return Network(nodes, self.links, self.intra, self.name)


def _parse_links(doc: dict[str, Any], source: str) -> tuple[list[str], dict[tuple[str, str], Link]]:
    unit = doc.get("bandwidth_unit", "GiB/s")
    if unit not in BANDWIDTH_UNITS:
        raise PlanError(f"{source}: unknown bandwidth_unit {unit!r}; use one of {', '.join(BANDWIDTH_UNITS)}")
    scale = BANDWIDTH_UNITS[unit]
    raw_regions, raw_links = doc.get("regions") or [], doc.get("links", [])
    if not isinstance(raw_regions, list) or not all(isinstance(r, str) for r in raw_regions):
        raise PlanError(f"{source}: regions must be a list of region names, got {_shape(raw_regions)}")
    if not isinstance(raw_links, list) or not all(isinstance(e, dict) for e in raw_links):
        raise PlanError(f"{source}: links must be a list of objects with a, b, latency_ms and bandwidth, "
                        f"got {_shape(raw_links)}")
    regions = list(raw_regions)
    links: dict[tuple[str, str], Link] = {}
    for i, entry in enumerate(raw_links):
        try:
            a, b = str(entry["a"]), str(entry["b"])
            lat, bw = float(entry["latency_ms"]), float(entry["bandwidth"])
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError(f"{source}: link #{i} needs a, b, latency_ms and bandwidth ({exc})") from None
        if not bw > 0:
            raise PlanError(f"{source}: link {a}-{b} has bandwidth {bw}; bandwidth must be positive")
        if lat < 0:
            raise PlanError(f"{source}: link {a}-{b} has negative latency {lat} ms")
        links[(a, b)] = Link(lat / 1000.0, bw * scale)
        for r in (a, b):
            if r not in regions:
                regions.append(r)
    if not regions:
        raise PlanError(f"{source}: no regions listed")
    return regions, links


def _shape(value: Any) -> str:
    """What a JSON value is, for an error message: 'a list', 'the number 3', ..."""
    names = {list: "a list", dict: "an object", str: "a string", bool: "a boolean", type(None): "null"}
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"the number {value}"
    return names.get(type(value), type(value).__name__)


def load_network_doc(spec: str) -> tuple[dict[str, Any], str]:
    """Read a preset name (gcp12, aws10) or a JSON file path; a file that is not a JSON object with
    regions and links is a PlanError naming it."""
    if spec in PRESETS:
        text = resources.files("roving.pipeline.planning").joinpath("data").joinpath(f"{spec}.json").read_text()
        return json.loads(text), spec
    path = Path(spec)
    if not path.is_file():
        raise PlanError(f"network {spec!r} is neither a preset ({', '.join(PRESETS)}) nor a file")
    try:
        doc = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise PlanError(f"{spec}: not valid JSON ({exc})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise PlanError(f"cannot read network file {spec}: {exc}") from None
    if not isinstance(doc, dict):
        raise PlanError(f"{spec}: a network file is a JSON object with regions and links, got {_shape(doc)}")
    return doc, path.stem


def build_network(
    spec: str | dict[str, Any],
    nodes: int | list[dict[str, Any]] | str,
    *,
    memory: int = DEFAULT_MEMORY,
    memory_mb: float | None = None,
    speed: float = PAPER_SECONDS_PER_SAMPLE_LAYER,
    regions: list[str] | None = None,
) -> Network:
    """A network from a preset/file/dict and either a node count (placed on regions round-robin),
    a list of node dicts (name, region, optional speed, and optional memory_mb (device MiB) or memory
    (microbatches in flight), not both) or the path of a JSON file of them. ``memory_mb`` and
    ``memory`` are the defaults for nodes that give neither (``memory_mb``, when set, decides; see
    ``Node``). ``regions`` restricts round-robin placement to those regions."""
    if isinstance(spec, dict):
        doc, source = spec, str(spec.get("name", "custom"))
    else:
        doc, source = load_network_doc(spec)
    where = spec if isinstance(spec, str) and spec not in PRESETS else source  # errors name the file
    all_regions, links = _parse_links(doc, where)
    if isinstance(nodes, str):
        nodes = _read_nodes_file(nodes)
    if isinstance(nodes, int):
        if nodes < 1:
            raise PlanError(f"need at least one node, got {nodes}")
        place = regions or all_regions
        unknown = [r for r in place if r not in all_regions]
        if unknown:
            raise PlanError(f"regions {unknown} are not in network {source}")
        node_list = [
            Node(f"n{i:02d}", place[i % len(place)], speed, memory, memory_mb) for i in range(nodes)
        ]
    else:
        node_list = [_node_from(d, i, all_regions, source, speed, memory, memory_mb) for i, d in enumerate(nodes)]
    intra = doc.get("intra")
    intra_link = INTRA_REGION_LINK
    if intra:
        scale = BANDWIDTH_UNITS[doc.get("bandwidth_unit", "GiB/s")]
        try:
            intra_link = Link(float(intra["latency_ms"]) / 1000.0, float(intra["bandwidth"]) * scale)
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError(f"{where}: intra must be an object with latency_ms and bandwidth ({exc!r})") from None
    net = Network(node_list, links, intra_link, source)
    log.debug("network %s: %d nodes over %d regions", source, len(node_list),
              len({n.region for n in node_list}))
    return net


def _read_nodes_file(path: str) -> list[dict[str, Any]]:
    """The node dicts of a nodes file: a JSON list of objects, or an object whose ``nodes`` is one."""
    try:
        nodes = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PlanError(f"cannot read nodes file {path}: {exc}") from None
    if isinstance(nodes, dict):
        nodes = nodes.get("nodes", [])
    if not isinstance(nodes, list) or not all(isinstance(d, dict) for d in nodes):
        raise PlanError(f"{path}: a nodes file is a JSON list of objects with name and region "
                        "(or an object whose nodes is one), got "
                        + (f"a list holding {_shape(next(d for d in nodes if not isinstance(d, dict)))}"
                           if isinstance(nodes, list) else _shape(nodes)))
    return nodes


def _node_from(d: dict[str, Any], i: int, regions: list[str], source: str, speed: float, memory: int,
               memory_mb: float | None) -> Node:
    """Node ``#i`` of a nodes list; ``speed``, ``memory`` and ``memory_mb`` are the defaults."""
    if "region" not in d or d["region"] not in regions:
        raise PlanError(f"node #{i}: region {d.get('region')!r} is not in network {source}")
    name = str(d.get("name", f"n{i:02d}"))
    if "memory" in d and "memory_mb" in d:
        raise PlanError(f"node {name}: give memory_mb (device MB) or memory (microbatches in "
                        "flight), not both")
    try:
        if "memory_mb" in d:
            mem, mem_mb = memory, float(d["memory_mb"])
        elif "memory" in d:
            mem, mem_mb = int(d["memory"]), None
        else:
            mem, mem_mb = memory, memory_mb
        node_speed = float(d.get("speed", speed))
    except (TypeError, ValueError) as exc:
        raise PlanError(f"node {name}: speed, memory and memory_mb must be numbers ({exc})") from None
    return Node(name, d["region"], node_speed, mem, mem_mb)


def slowed(network: Network, factors: dict[str, float]) -> Network:
    """The same network with some nodes' compute slowed by a factor (2.0 = twice as slow)."""
    return network.with_nodes([
        replace(n, speed=n.speed * factors[n.name]) if n.name in factors else n for n in network.nodes
    ])
