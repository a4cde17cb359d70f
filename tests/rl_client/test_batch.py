"""A batch of rollouts laid out as NeMo RL's generation output, element by element."""

from __future__ import annotations

import numpy as np
import pytest

from rl_client.batch import assemble, prompts_from_padded, routed_experts_dtype
from rl_client.driver import RolloutResult, RoutedExperts

LAYERS, TOP_K = 3, 2


def routes(rows: int, seed: int) -> RoutedExperts:
    data = np.random.default_rng(seed).integers(0, 8, size=(rows, LAYERS, TOP_K), dtype=np.uint8)
    return RoutedExperts(data.tobytes(), "uint8", data.shape)


def result(tokens: list[int], finish: str, experts: RoutedExperts | None = None) -> RolloutResult:
    logprobs = [-0.125 * (i + 1) for i in range(len(tokens))]
    return RolloutResult(
        tokens, logprobs, finish == "length" and bool(tokens), finish, None, experts
    )


PROMPTS = [[5, 6, 7], [8], [9, 10, 11, 12]]
RESULTS = [
    result([20, 21, 22, 23], "length", routes(3 + 4 - 1, 0)),  # complete routes
    result([30], "stop", routes(1 + 1 - 1 - 1, 1)),  # one route missing
    result([], "length", routes(4 - 1, 2)),  # nothing generated
]


def check_row(out, i: int, prompt: list[int], res: RolloutResult, pad: int) -> None:  # type: ignore[no-untyped-def]
    n_in, n_gen = len(prompt), len(res.token_ids)
    row = out.output_ids[i]
    assert row[:n_in].tolist() == prompt
    assert row[n_in : n_in + n_gen].tolist() == res.token_ids
    assert (row[n_in + n_gen :] == pad).all()
    lp = out.logprobs[i]
    assert (lp[:n_in] == 0).all() and (lp[n_in + n_gen :] == 0).all()
    assert lp[n_in : n_in + n_gen].tolist() == pytest.approx(res.logprobs)
    assert out.generation_lengths[i] == n_gen and out.unpadded_sequence_lengths[i] == n_in + n_gen
    assert out.truncated[i] == res.truncated


def test_rows_hold_prompt_then_generation_then_padding() -> None:
    out = assemble(PROMPTS, RESULTS, pad_token_id=2, num_routed_experts=8)
    width = 4 + 4  # longest prompt + longest generation
    assert out.output_ids.shape == out.logprobs.shape == (3, width)
    assert out.output_ids.dtype == np.int64 and out.logprobs.dtype == np.float32
    assert out.generation_lengths.dtype == out.unpadded_sequence_lengths.dtype == np.int64
    assert out.truncated.dtype == np.bool_ and out.truncated.tolist() == [True, False, False]
    for i, (prompt, res) in enumerate(zip(PROMPTS, RESULTS, strict=True)):
        check_row(out, i, prompt, res, pad=2)


def test_routed_experts_are_aligned_as_nemo_rl_aligns_them() -> None:
    out = assemble(PROMPTS, RESULTS, pad_token_id=2, num_routed_experts=8)
    experts = out.routed_experts
    assert experts is not None and experts.shape == (3, 8, LAYERS, TOP_K)
    assert experts.dtype == np.int8  # 8 experts and -1 fit int8
    default = np.arange(TOP_K)
    for i, res in enumerate(RESULTS):
        assert res.routed_experts is not None
        own = res.routed_experts.to_numpy()
        expected = len(PROMPTS[i]) + len(res.token_ids) - 1
        copied = min(expected, own.shape[0])
        assert (experts[i, :copied] == own[:copied]).all()
        assert (experts[i, copied:expected] == -1).all()  # missing routes
        assert (experts[i, expected:] == default).all()  # past the sequence: default route
        assert out.r3_routed_experts_expected_routes[i] == expected
        assert out.r3_routed_experts_actual_routes[i] == own.shape[0]
        assert out.r3_routed_experts_missing_routes[i] == max(expected - own.shape[0], 0)
    assert out.r3_routed_experts_missing_routes.tolist() == [0, 1, 0]


def test_no_routed_experts_no_r3_keys() -> None:
    plain = [result([1], "stop"), result([2, 3], "length")]
    out = assemble([[4], [5]], plain, pad_token_id=0)
    assert out.routed_experts is None
    assert set(out.to_dict()) == {
        "output_ids",
        "logprobs",
        "generation_lengths",
        "unpadded_sequence_lengths",
        "truncated",
    }


@pytest.mark.parametrize(
    ("experts", "dtype"),
    [(None, np.int16), (8, np.int8), (128, np.int8), (129, np.int16), (40000, np.int32)],
)
def test_narrowest_dtype_for_experts_and_the_missing_mark(experts: int | None, dtype: type) -> None:
    assert routed_experts_dtype(experts) == np.dtype(dtype)


def test_padded_prompts_keep_their_width_and_dtype() -> None:
    ids = np.array([[5, 6, 7, 2, 2], [8, 2, 2, 2, 2]], dtype=np.int32)
    prompts, width, dtype = prompts_from_padded(ids, [3, 1])
    assert prompts == [[5, 6, 7], [8]] and width == 5 and dtype == np.int32
    out = assemble(
        prompts,
        [result([40], "stop"), result([41, 42], "length")],
        pad_token_id=2,
        padded_input_length=width,
        ids_dtype=dtype,
    )
    assert out.output_ids.shape == (2, 5 + 2) and out.output_ids.dtype == np.int32
    check_row(out, 0, [5, 6, 7], out.results[0], pad=2)
    with pytest.raises(ValueError, match="input_lengths"):
        prompts_from_padded(ids, [0, 1])


def test_the_arrays_become_torch_tensors_as_the_readme_says() -> None:
    torch = pytest.importorskip("torch", reason="torch tensors need torch")
    arrays = assemble(PROMPTS, RESULTS, pad_token_id=2, num_routed_experts=8).to_dict()
    out = {k: torch.from_numpy(v) for k, v in arrays.items()}
    assert out["output_ids"].dtype == torch.int64 and out["routed_experts"].dtype == torch.int8
    assert out["logprobs"].dtype == torch.float32 and out["truncated"].dtype == torch.bool
