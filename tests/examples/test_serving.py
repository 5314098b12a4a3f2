"""The serving demo: the paged, continuously batched engine's greedy tokens equal the fp32 reference's."""
import pytest
import torch

from helpers import DEVICE
from examples.serving.check import check_request, describe
from examples.serving.cli import main as demo_main
from examples.serving.engine import Engine, Request
from examples.serving.model import PRESETS, build_model, fp32_copy

PAGE_SIZE = 4  # small pages: prompts and decode appends cross page edges


@pytest.fixture(autouse=True)
def _one_thread():
    # A tiny model gains nothing from torch's OpenMP workers, and on a busy 2-core machine they slow each small
    # matmul down by orders of magnitude (see examples/serving/cli.py).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model():
    return build_model(PRESETS["tiny"], seed=3, device=DEVICE)


def make_requests(vocab):
    g = torch.Generator().manual_seed(4)

    def prompt(n):
        return torch.randint(vocab, (n,), generator=g).tolist()

    # (prompt length, max_new_tokens, arrival step). Lifetimes 12, 3, 17, 9 tokens = 3, 1, 5, 3 pages of 4.
    return [
        Request(0, prompt(7), 6, arrival=0),  # decode appends cross the page edge at position 8
        Request(1, prompt(1), 3, arrival=0),  # a one-token prompt; finishes first and frees its page
        Request(2, prompt(13), 5, arrival=0),  # prefill spans 4 pages, the last one partly
        Request(3, prompt(5), 5, arrival=1),  # arrives while 0-2 run; waits for request 1's page
    ]


@pytest.mark.parametrize("backend", ["tileflash", "sdpa"])
def test_engine_matches_reference(model, backend):
    num_pages = 11  # requests 0-2 take 9 pages; request 3 (3 pages) fits only once request 1 has finished
    engine = Engine(model, num_pages=num_pages, page_size=PAGE_SIZE, max_batch=4, max_seq_len=20, backend=backend,
                    record_logits=True)
    requests = make_requests(model.cfg.vocab)
    stats = engine.run(requests)

    late, first = requests[3], requests[1]
    assert [r.admitted for r in requests[:3]] == [0, 0, 0]
    assert late.admitted == first.finished + 1 > late.arrival, "request 3 must wait for request 1's page"
    assert all(r.finished > late.admitted for r in (requests[0], requests[2])), "request 3 must join a running batch"
    assert max(stats.decode_batch_sizes) == 3
    assert engine.allocator.num_free == num_pages, "pages leaked"

    model32 = fp32_copy(model)
    for r in requests:
        assert len(r.output) == r.max_new_tokens
        result = check_request(model, model32, engine.attn_dtype, r)
        assert not result.mismatches, "\n".join(describe(backend, result))
        # Every position's logits are within 2x the rounding of a reference in the engine's precision.
        assert result.logits_within_bound, (result.max_logit_diff, result.max_lowp_diff)


def test_cli_runs(capsys):
    assert demo_main(["--backend", "sdpa", "--requests", "3", "--max-new-tokens", "3", "--seed", "1"]) == 0
    out = capsys.readouterr().out
    assert "per request" in out and "throughput" in out
