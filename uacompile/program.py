"""A Program is a networkx DiGraph of op nodes and tensor nodes.

Edges go tensor -> op for inputs and op -> tensor for outputs. An op that updates a tensor
in place (an inout parameter, e.g. reshape_and_cache's caches) reads its latest version and
writes a new version node `name@op_id`, so the graph stays acyclic and later readers are ordered
after the update; ops keep binding the tensor's name (versions share its buffer). Passes are
plain functions Program -> Program.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import networkx as nx

from .errors import IRError
from .ir import OpSpec, TensorSpec


@dataclass
class Program:
    graph: nx.DiGraph = field(default_factory=nx.DiGraph)
    _count: int = 0
    _latest: dict = field(default_factory=dict)  # tensor name -> its newest version node
    _previous: dict = field(default_factory=dict)  # version node -> the node it updated

    def add_tensor(self, name: str, dtype: str, shape) -> str:
        if name in self.graph:
            raise IRError(f"tensor {name}", "is defined twice")
        self.graph.add_node(name, kind="tensor", spec=TensorSpec(name, dtype, tuple(shape)))
        return name

    def add_op(self, op: OpSpec, **bind: str) -> str:
        """Add op with its tensor params bound to tensor names; missing outputs are created."""
        op_id = f"{op.kind}_{self._count}"
        self._count += 1
        self.graph.add_node(op_id, kind="op", spec=op, bind=dict(bind))
        sym = {}  # the op's symbolic dims -> the bound tensors' dims, to shape created outputs
        for p in op.tensors():
            if bind.get(p.name) in self.graph:
                for want, got in zip(p.shape, self.tensor(bind[p.name]).shape):
                    sym.setdefault(want, got)
        for p in op.tensors():
            name = bind.get(p.name)
            if name is None:
                if p.role == "in":
                    raise IRError(f"{op_id}.{p.name}", "input is not bound to a tensor")
                name = bind[p.name] = f"{p.name}_{op_id}"
                self.add_tensor(name, p.dtype, [sym.get(d, d) for d in p.shape])
            elif name not in self.graph:
                raise IRError(f"{op_id}.{p.name}", f"tensor {name!r} does not exist")
            if p.role in ("in", "inout"):
                self.graph.add_edge(self.latest(name), op_id, param=p.name)
            if p.role == "out":
                self.graph.add_edge(op_id, name, param=p.name)
            if p.role == "inout":
                version = f"{name}@{op_id}"
                self.graph.add_node(version, kind="tensor", spec=self.tensor(name), version_of=name)
                self.graph.add_edge(op_id, version, param=p.name)
                self._previous[version] = self.latest(name)
                self._latest[name] = version
        self.graph.nodes[op_id]["bind"] = dict(bind)
        return op_id

    def ops(self) -> list[str]:
        """Op ids in a topological order."""
        return [n for n in nx.topological_sort(self.graph) if self.graph.nodes[n]["kind"] == "op"]

    def op(self, op_id: str) -> OpSpec:
        return self.graph.nodes[op_id]["spec"]

    def tensor(self, name: str) -> TensorSpec:
        return self.graph.nodes[name]["spec"]

    def latest(self, name: str) -> str:
        """The node of tensor `name` after every in-place update added (and not removed) so far."""
        node = self._latest.get(name, name)
        while node not in self.graph and node in self._previous:  # its update was removed
            node = self._previous[node]
        return node


def validate(prog: Program) -> Program:
    """Every op's bound tensors agree in dtype and static dims; the graph is acyclic;
    every tensor (version) has at most one writer."""
    g = prog.graph
    if not nx.is_directed_acyclic_graph(g):
        raise IRError("program", f"has a cycle: {nx.find_cycle(g)}")
    for op_id in (n for n in g if g.nodes[n]["kind"] == "op"):
        op, bind = g.nodes[op_id]["spec"], g.nodes[op_id]["bind"]
        sym: dict[str, int | str] = {}
        for p in op.tensors():
            if p.name not in bind:
                if p.role == "in":
                    raise IRError(f"{op_id}.{p.name}", "input is not bound to a tensor")
                continue
            t = prog.tensor(bind[p.name])
            if t.dtype != p.dtype:
                raise IRError(f"{op_id}.{p.name}.dtype", f"op needs {p.dtype}, tensor {t.name} is {t.dtype}")
            if len(t.shape) != len(p.shape):
                raise IRError(f"{op_id}.{p.name}.shape", f"op needs rank {len(p.shape)}, tensor {t.name} has {t.shape}")
            for want, got in zip(p.shape, t.shape):
                if isinstance(want, int):
                    if isinstance(got, int) and got != want:
                        raise IRError(f"{op_id}.{p.name}.shape", f"op needs {p.shape}, tensor {t.name} has {t.shape}")
                elif sym.setdefault(want, got) != got:
                    raise IRError(f"{op_id}.{p.name}.shape",
                                  f"dim {want} is {sym[want]} elsewhere but {got} in tensor {t.name}")
    for t in (n for n in g if g.nodes[n]["kind"] == "tensor"):
        writers = list(g.predecessors(t))
        if len(writers) > 1:
            raise IRError(f"tensor {t}", f"is written by several ops: {writers}")
    return prog


def dead_op_elimination(prog: Program, outputs: list[str]) -> Program:
    """Drop ops none of whose outputs reach one of `outputs`."""
    g = prog.graph
    live = set(outputs) | {prog.latest(o) for o in outputs}
    for o in list(live):
        live |= nx.ancestors(g, o)
    g.remove_nodes_from([n for n in list(g) if n not in live])
    return prog


def run_reference(prog: Program, arrays: dict) -> dict:
    """Execute a program with the numpy reference; arrays maps tensor names to values."""
    from . import reference

    env = dict(arrays)
    for op_id in prog.ops():
        op, bind = prog.op(op_id), prog.graph.nodes[op_id]["bind"]
        args = {p.name: env[bind[p.name]] for p in op.tensors() if p.role != "out" and p.name in bind}
        res = reference.run(op, **args)
        if op.kind in ("paged_attention", "merge_state"):
            for n, v in zip(("out", "lse"), res):
                if n in bind:
                    env[bind[n]] = v
        elif op.kind in ("rms_norm", "silu_and_mul") and "out" in bind:
            env[bind["out"]] = res
    return env
