"""tools/relayout_machine.py (issue 98: the infrastructure out of ``merge/`` into the bottom package ``machine/``):
on a small tree of the same shape it moves the modules, rewrites their references, declares the layers, and a
second run changes nothing. The script leaves this file alone (its old names are the inputs)."""

from __future__ import annotations

from pathlib import Path

from support import load_tool, relayout_again, relayout_once


def _tree() -> dict[str, str]:
    return {
        "resumerge/__init__.py": '"""resumerge."""\n',
        "resumerge/torch_import.py": '"""torch, on first use."""\n\ntorch = None\n',
        "resumerge/memory/__init__.py": '"""Memory.\n\nMay import: errors.\n"""\n\n'
                                        "from resumerge.torch_import import torch\n\n__all__ = [\"sizes\"]\n",
        "resumerge/memory/sizes.py": '"""Sizes."""\n',
        "resumerge/merge/__init__.py": '"""The merge."""\n\n__all__ = ["engine", "store"]\n',
        "resumerge/merge/store/__init__.py": '"""The store.\n\nMay import: errors.\n"""\n\n'
                                             '__all__ = [\n    "durable",\n    "killpoints",\n    "ledger",\n]\n',
        "resumerge/merge/store/killpoints.py": '"""Kill points."""\n\n\ndef reach() -> None: ...\n',
        "resumerge/merge/store/durable.py": '"""Durable writes (:mod:`.killpoints`)."""\n\n'
                                            "from resumerge.merge.store import killpoints\n\n\n"
                                            "def write() -> None:\n    killpoints.reach()\n",
        "resumerge/merge/store/ledger.py": '"""The ledger (:mod:`.durable`)."""\n\n'
                                           "from resumerge.merge.store.durable import write\n",
        "resumerge/merge/engine/__init__.py": '"""The engine.\n\nMay import: errors, merge.store.\n"""\n\n'
                                              "__all__: list[str] = []\n",
        "resumerge/merge/engine/cluster/__init__.py": '"""The cluster."""\n\n__all__ = ["connect", "driver"]\n',
        "resumerge/merge/engine/cluster/connect.py": '"""Ray, joined."""\n\n\ndef join() -> None: ...\n',
        "resumerge/merge/engine/cluster/driver.py": '"""The driver."""\n\n'
                                                    "from resumerge.merge.engine.cluster.connect import join\n"
                                                    "from resumerge.merge.store.ledger import write\n"
                                                    "from resumerge.merge.engine.cluster import kept\n",
        "resumerge/merge/engine/cluster/kept.py": '"""Kept workers (:mod:`.hosting`)."""\n\n'
                                                  "from resumerge.merge.engine.cluster.connect import join\n",
        "resumerge/merge/engine/cluster/hosting.py": '"""Hosting."""\n\nfrom resumerge.merge.engine.cluster.kept '
                                                     "import join\n",
        "resumerge/forward/onray.py": '"""On Ray."""\n\n\ndef hosts() -> None:\n'
                                      "    from resumerge.merge.engine.cluster.hosting import join\n",
        "resumerge/forward/__init__.py": '"""The forward engine.\n\nMay import: errors, memory, merge.store (durable), '
                                         'merge.engine.\n"""\n\n__all__: list[str] = []\n',
        "resumerge/forward/driver.py": '"""A pass."""\n\nfrom resumerge.merge.engine.cluster.connect import join\n'
                                       "from resumerge.merge.store.durable import write\n"
                                       "from resumerge.torch_import import torch\n",
        "tests/test_x.py": 'TARGET = "resumerge.merge.store.durable.write"\nFILE = "resumerge/memory/sizes.py"\n',
        "docs/dev.md": "See `resumerge/merge/store/killpoints.py` and `torch_import.py`.\n",
    }


def test_the_move_rewrites_references_declares_and_a_second_run_changes_nothing(tmp_path: Path) -> None:
    tool, said = relayout_once("relayout_machine", tmp_path, _tree())
    pkg = tmp_path / "resumerge"
    assert not (pkg / "merge" / "store" / "durable.py").exists() and not (pkg / "memory").exists()
    for moved in ("durable.py", "killpoints.py", "torch_import.py", "rayconnect.py", "memory/sizes.py"):
        assert (pkg / "machine" / moved).is_file(), moved
    forward = (pkg / "forward" / "driver.py").read_text()
    assert "from resumerge.machine.durable import write" in forward
    assert "from resumerge.machine.rayconnect import join" in forward
    assert "from resumerge.machine.torch_import import torch" in forward
    # ``from resumerge.merge.store import killpoints``: the module moved, the name stays
    assert "from resumerge.machine import killpoints" in (pkg / "machine" / "durable.py").read_text()
    assert "from resumerge.machine.durable import write" in (pkg / "merge" / "store" / "ledger.py").read_text()
    assert ":mod:`resumerge.machine.durable`" in (pkg / "merge" / "store" / "ledger.py").read_text()
    assert (tmp_path / "tests" / "test_x.py").read_text() == (
        'TARGET = "resumerge.machine.durable.write"\nFILE = "resumerge/machine/memory/sizes.py"\n')
    assert (tmp_path / "docs" / "dev.md").read_text() == (
        "See `resumerge/machine/killpoints.py` and `machine/torch_import.py`.\n")
    # the packages the modules left no longer list them; the bottom package says its job and lists what it holds
    assert '"durable"' not in (pkg / "merge" / "store" / "__init__.py").read_text()
    assert '__all__ = ["driver"]' in (pkg / "merge" / "engine" / "cluster" / "__init__.py").read_text()
    # the kept workers and the passes' hosting: the bottom package's own package, which it lists
    assert not (pkg / "merge" / "engine" / "cluster" / "kept.py").exists()
    assert "    from resumerge.machine.cluster.hosting import join\n" in (pkg / "forward" / "onray.py").read_text()
    driver = (pkg / "merge" / "engine" / "cluster" / "driver.py").read_text()
    assert "from resumerge.machine.cluster import kept" in driver
    assert "from resumerge.machine.cluster.kept import join" in (pkg / "machine" / "cluster" / "hosting.py").read_text()
    cluster = (pkg / "machine" / "cluster" / "__init__.py").read_text()
    assert "May import: errors, config, machine." in cluster and '    "hosting",\n    "kept",\n' in cluster
    bottom = (pkg / "machine" / "__init__.py").read_text()
    assert "May import: errors, config." in bottom and '"memory",' in bottom and '"torch_import",' in bottom
    assert '__all__ = [\n    "cluster",\n    "durable",\n' in bottom
    # forward imports nothing of merge/ any more: memory is the bottom package, the emptied layers are dropped
    assert "May import: errors, machine.\n" in (pkg / "forward" / "__init__.py").read_text()
    assert "May import: errors, machine, merge.store.\n" in (pkg / "merge" / "engine" / "__init__.py").read_text()
    assert any("write resumerge/machine/__init__.py" in line for line in said)

    assert relayout_again(tool, tmp_path) == []


def test_a_line_s_prose_naming_a_moved_module_is_left_for_a_person() -> None:
    tool = load_tool("relayout_machine")
    text = '"""Moe.\n\nMay import: errors, merge.store (killpoints, ledger), torch_import.\n"""\n'
    new, left = tool.declared(text, "runs.moe", {"errors", "merge.store", "machine"})
    assert "May import: errors, merge.store (killpoints, ledger), machine.\n" in new
    assert left == ["runs.moe: 'May import:' prose names a module now in machine/: merge.store (killpoints, ledger)"]
