"""DELLA's output bytes pinned: merges of fixed tensors hash to digests taken before its ranking was made cheaper.

DELLA draws random masks whose keep probability follows each entry's magnitude rank in its row, so a change to how
the ranks are found (a cheaper sort, another scatter) must leave every rank, every draw and every rounding alone.
The inputs are built from integer arithmetic alone (exact, the same on every machine), with exact zeros and equal
magnitudes in every row so the tie rule is exercised, over every dtype, row blocks of the default size (one shape
is cut into two), a 3-D tensor, a 1-D one and rows of one entry. The digests were computed on main at 4f8beeb.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

from methods.conftest import Merge

# (dtype, shape) -> {method: sha256 of the merged tensor's bytes}
PINNED: dict[tuple[str, tuple[int, ...]], dict[str, str]] = {
    ("float32", (520, 256)): {
        "della": "4cd975b8f128bbd05c2cdeeb0e29daff688fe64933569c461448735cedb52cca",
        "della_linear": "e6532af1bf662deb6b979864251b5852f1b23d6296e94027db4a8ece94b03aa0",
    },
    ("bfloat16", (520, 256)): {
        "della": "6c597a063be709048ac186405dd51e2612bb3fdd8ed78deee4b1a5d51be42bee",
        "della_linear": "d476a9016cb868e7120ea12e79ddb9f65d5f157da729115f1ba728e44d937b55",
    },
    ("float16", (40, 96)): {
        "della": "60ce976d70d1a862b1e00aa9148fd1999ab3eff6dd2a58766ba2666643801a7e",
        "della_linear": "106d273b89a4eb178c81c017e2d4a9c8cbfb11271a6d9601ff0e05fa66ae1841",
    },
    ("float64", (40, 96)): {
        "della": "47edf807271e67bec44ab6ad8a9e5b618e9fe165144f4b1f5c7396f76b8a4e68",
        "della_linear": "b7fa4460549ab97e11c4c870b77aecb19cc852c5684bda56bbfb1d4a13badedc",
    },
    ("float32", (3, 5, 70)): {
        "della": "907ac06281d6db6a17616d42b0e76e99a712dafdee83a443543d2b14aa7c5b16",
        "della_linear": "100741f5740340565c598e66635950ca1eb36f1efd359e64f925b34f2e28fa0a",
    },
    ("bfloat16", (3, 5, 70)): {
        "della": "cb907c2ea382efb7d19608b89148063ed54cb3d6b068d8826eee939ae2cd6fd6",
        "della_linear": "a4ba7e6e3d070df0c38761b0b901ef5283086d60bf3f92dea302da178b1c457a",
    },
    ("float32", (300,)): {
        "della": "2ba6a5bdd4d8a5534033cb83cf7b957fa22fbbfe017d856f309e1479ffe0e4ac",
        "della_linear": "d71bcafd418f8cc4fbb55f9807413e8e4dfe6f487d68483839fe54030e5985b3",
    },
    ("float32", (9, 1)): {
        "della": "5482b8aff962291ba0153e67631749204e8d5fa328b65b65bfeab28723889714",
        "della_linear": "bb8fd6aae5ace6e932c7a5938718f4273e625281a66a325a906baf4429de55ef",
    },
}


def _inputs(dtype: torch.dtype, shape: tuple[int, ...], models: int = 4) -> list[torch.Tensor]:
    count = 1
    for size in shape:
        count *= size
    index = torch.arange(count, dtype=torch.int64)
    base = ((index * 7919) % 2011 - 1005).to(torch.float64) / 512
    # Task vectors of 61 levels: each row holds equal magnitudes and exact zeros.
    deltas = [((index * prime + shift) % 61 - 30).to(torch.float64) / 256
              for prime, shift in ((104729, 3), (1299709, 17), (15485863, 29))[: models - 1]]
    return [t.reshape(shape).to(dtype) for t in (base, *(base + d for d in deltas))]


def _digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


@pytest.mark.parametrize(("dtype", "shape"), sorted(PINNED), ids=str)
def test_della_merges_keep_their_bytes(merge: Merge, dtype: str, shape: tuple[int, ...]) -> None:
    tensors = _inputs(getattr(torch, dtype), shape)
    per_model = {"density": [None, 0.5, 0.3, 0.7], "epsilon": [None, 0.1, 0.2, 0.15],
                 "weight": [None, 0.3, 0.5, 0.4]}
    found = {}
    for method in ("della", "della_linear"):
        out = merge(method, [t.clone() for t in tensors], base=0, per_model=per_model, seed=1234)
        assert out.dtype == tensors[0].dtype and out.shape == tensors[0].shape
        found[method] = _digest(out)
    assert found == PINNED[(dtype, shape)]
