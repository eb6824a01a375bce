"""What every forward pass placed on a Ray cluster shares, whoever's pass it is (``check``'s, ``measure``'s,
``eval``'s, the MoE hidden-state gates'): where each model's actor runs (:func:`ray_places`, :func:`places`:
before any weight is read, the cluster refused where it cannot hold the actors), how a model travels to its actor
(:func:`sent`) and how the actor opens it on its node (:func:`on_node`), with each range of a hub file it reads
noted for the driver's journal (:func:`logged`: the driver holds them to the pass's proof, as it holds its own), and
which actors a node's kept worker hosts (:func:`kept_hosts`, on a cluster that outlives the pass).

Every pass's actor is the one of :mod:`resumerge.forward.placing.rayactor` (``measure``'s Grams computed on it by a
node-side watch, :class:`~resumerge.forward.job.placement.NodeWatch`); this module is the one owner of what a pass's
actors share with the other uses of a cluster's nodes. Ray is joined through
:mod:`resumerge.machine.rayconnect` (the merge executor's own).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from resumerge.errors import ResumergeError, UsageError
from resumerge.forward.opening.opened import PassModel
from resumerge.machine.memory.sizes import format_size

Read = tuple[str, int, int, str]  # a range of a hub file an actor read: (file, start, end, sha256)


@dataclass(frozen=True)
class Place:
    """Where a model's actor runs: its node (the full id), the CPUs and the memory (bytes) it declares."""

    node_id: str
    cpus: float
    memory: int


def ray_places(address: str | None, needs: Sequence[int], what: str = "check") -> list[Place]:
    """Join the Ray cluster at ``address`` (None: ``RAY_ADDRESS``, else a Ray started on this machine) and place
    each model's actor (``needs``: the memory each declares), before any weight is read: see :func:`places`.
    Raises :class:`~resumerge.errors.UsageError` without Ray or where the cluster cannot hold the actors,
    :class:`~resumerge.errors.UnreachableError` where it cannot be joined. ``what``: the pass, as the refusals name
    it (``check``, ``measurement``)."""
    from resumerge.machine.rayconnect import join

    return places(join(address).nodes(), needs, what)


def places(nodes: Sequence[dict[str, Any]], needs: Sequence[int], what: str = "check") -> list[Place]:
    """For each model, the node its actor runs on, the CPUs and the memory it declares: the alive ``nodes``
    (``ray.nodes()``) with CPUs, most CPUs first, one model each, round-robin where there are fewer nodes than
    models, each node given only the actors its memory (as the node declares it to Ray) holds; each model takes its
    share of its node's CPUs (whole CPUs where the node has them, at least a hundredth). Raises
    :class:`~resumerge.errors.UsageError` (exit 2) where no node has a CPU, or the nodes cannot hold every model's
    actor at once (the pass runs them side by side)."""
    alive = sorted(((float(n["Resources"].get("CPU", 0)), int(n["Resources"].get("memory", 0)), n["NodeID"])
                    for n in nodes if n.get("Alive") and n["Resources"].get("CPU", 0) > 0),
                   key=lambda n: (-n[0], n[2]))
    if not alive:
        raise UsageError(f"the Ray cluster has no node with CPUs to run a {what} on",
                         hint=f"add a node with CPUs, or run the {what} without --executor ray")
    largest = max(memory for _, memory, _ in alive)
    holds = "its heads" if what == "check" else "its sums"
    if min(needs) > largest:
        raise UsageError(f"a model's actor of the {what} needs {format_size(min(needs))} of a Ray node's memory "
                         f"(torch, a layer in float32, its hidden states, {holds}), more than any node of the cluster "
                         f"has (the most: {format_size(largest)})", hint=_small_hint(what))
    free = {node: memory for _, memory, node in alive}
    chosen: list[tuple[str, float, int]] = []
    turn = 0
    for m, need in enumerate(needs):
        for k in range(len(alive)):
            cpus, _, node = alive[(turn + k) % len(alive)]
            if free[node] >= need:
                free[node] -= need
                chosen.append((node, cpus, need))
                turn = (turn + k + 1) % len(alive)
                break
        else:
            raise UsageError(f"the Ray cluster's nodes hold {m} of the {what}'s {len(needs)} models' actors at once "
                             f"(each needs {format_size(need)} of a node's memory; the pass runs them side by side)",
                             hint=_small_hint(what))
    shares = Counter(node for node, _, _ in chosen)
    return [Place(node, cpus_of(cpus / shares[node]), need) for node, cpus, need in chosen]


def _small_hint(what: str) -> str:
    return f"add nodes with more memory to the cluster (ray start --memory), or run the {what} without --executor ray"


def cpus_of(share: float) -> float:
    """The CPUs an actor declares for a ``share`` of a node's: whole ones where the share has one, at least a
    hundredth."""
    return max(0.01, float(int(share)) or round(share, 2))


def logged(model: PassModel, log: list[Read]) -> PassModel:
    """``model`` with each range of its hub files read noted in ``log`` (with its sha256), for the driver."""
    if not model.remote:
        return model
    import hashlib
    from dataclasses import replace

    from resumerge.inputs.hub.stream import StreamedReads

    def note(file: str, start: int, end: int, data: bytearray) -> None:
        log.append((file, start, end, hashlib.sha256(data).hexdigest()))

    return replace(model, reads=StreamedReads({f.file: f.client() for f in model.remote}, note))


def on_node(model: PassModel, token: bool, state: str | None = None) -> PassModel:
    """``model`` as this node opens it: as the driver opened it where its folder is here, else (a hub model whose
    cache snapshot is the driver's) its small files fetched into this node's cache, its weights read by range; a hub
    model's ranges asked under this node's name (``resumerge-node/NODE`` in the user agent, as a merge's nodes ask
    theirs: the hub's logs tell the nodes apart) with this node's token (``HF_TOKEN``, or its user's saved login).
    Raises :class:`UsageError` (exit 2) for a hub model where the driver read with a token (``token``) and this
    node has none, as a merge's nodes refuse to read its hub inputs. ``state``: the state dir given with
    ``--state-dir`` (None: the default), which a GGUF or hub model is opened under."""
    from dataclasses import replace

    from resumerge.machine.rayconnect import this_node

    node = this_node()
    if token and model.remote:
        from huggingface_hub import get_token

        if not get_token():
            raise UsageError(f"cluster node {node} has no Hugging Face token to read {model.path} with",
                             hint="set HF_TOKEN (or run `hf auth login`) on every node, then run the pass again: "
                                  "it resumes at the last layer journaled")
    if not model.opened.directory.is_dir():
        from resumerge.config.locations import StateDir
        from resumerge.forward.opening.opened import open_for_pass

        model = replace(open_for_pass(model.path, model.role, StateDir.resolve(state)), role=model.role,
                        weight=model.weight)
    agent = f"resumerge-node/{node}"
    return replace(model, remote=tuple(replace(f, agent=agent) for f in model.remote))


def sent(model: PassModel) -> PassModel:
    """``model`` as sent to its actor: without this process's readers of its hub files (their journal is the
    driver's; the node reads by range with clients of its own) nor the headers they check with."""
    from dataclasses import replace

    return replace(model, reads=None, headers={})


def driver_token() -> bool:
    """Whether this process reads the hub with a token (only whether: the token itself never leaves it)."""
    from huggingface_hub import get_token

    return bool(get_token())


def kept_hosts(ray: Any, placed: Sequence[Place], keep: float, stream: str) -> list[Any]:
    """For each actor of a pass ``placed`` so, the kept worker of its node that hosts it
    (:func:`~resumerge.machine.cluster.hosting.lease_hosts`: leased, the actor's CPUs and memory reserved on its
    node, idle for at most ``keep`` seconds once the pass ends, one made for the lease computing a later merge's
    shards with the class named ``stream``), else None: a fresh actor (``keep`` 0: the cluster was started for the
    pass, or ``keep_workers=0``; no ``stream`` named; no kept worker free on the node; its reservation not up in
    time)."""
    if keep <= 0 or not stream:
        return [None] * len(placed)
    from resumerge.machine.cluster.hosting import lease_hosts

    try:
        return list(lease_hosts(ray, [(p.node_id, p.cpus, p.memory) for p in placed], keep, stream))
    except Exception:  # (what it leased is ended) the pass starts fresh actors, which say what is wrong if anything
        return [None] * len(placed)


def on_place(ray: Any, place: Place, host: Any, factory: Callable[..., Any], *args: Any) -> Any:
    """A pass's object made as ``factory(*args)`` on ``place``'s node, called as a Ray actor (``.NAME.remote``):
    hosted by the kept worker ``host`` (:func:`kept_hosts`, whose lease reserved the place's CPUs and memory), else
    (None) by a fresh actor pinned there declaring them
    (:func:`~resumerge.machine.cluster.hosting.fresh_host`). The one way every pass's object (a model's
    :class:`~resumerge.forward.placing.modelnode.ModelNode`, a search's group of candidates) gets onto a node."""
    if host is None:
        from resumerge.machine.cluster.hosting import fresh_host

        host = fresh_host(ray, place.node_id, place.cpus, place.memory)
    host.host(factory, *args)
    return host


class Lost(Exception):
    """A pass's actor was lost (its process or node died), or an object another actor returned for the step."""


def got(ray: Any, refs: Any) -> Any:
    """``ray.get(refs)``: the error an actor's object raised said as the pass says it here (a
    :class:`~resumerge.errors.ResumergeError` raised as itself), a lost actor or object as :class:`Lost`."""
    try:
        return ray.get(refs)
    except ray.exceptions.RayTaskError as exc:
        if isinstance(exc.cause, ResumergeError):
            raise exc.cause from None
        raise
    except ray.exceptions.RayError as exc:
        raise Lost(type(exc).__name__) from None


def end_actors(ray: Any, actors: Sequence[Any], hosts: Sequence[Any]) -> None:
    """End a pass's ``actors`` (:func:`on_place`'s) and the kept workers of ``hosts`` whose actors were replaced:
    the fresh ones killed, the kept ones released (their pass objects dropped, idle for the next run or pass;
    killed where they do not answer)."""
    from resumerge.machine.cluster.hosting import end_hosts

    end_hosts(ray, list({id(each): each for each in (*hosts, *actors) if each is not None}.values()))
