"""tileflash as a transformers attention backend: a tiny Llama built from a config with random weights gives the
same logits (2x rule against fp32 SDPA) and greedy tokens as attn_implementation="sdpa"."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

import tileflash.integrations.transformers as tf_hf  # noqa: E402
from helpers import DEVICE  # noqa: E402
from tileflash.reference import error_and_bound  # noqa: E402

CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256)


@pytest.fixture(scope="module")
def models():
    name = tf_hf.register()
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).eval()

    def build(impl, dtype):
        m = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**CONFIG),
                                                          attn_implementation=impl).eval()
        assert m.config._attn_implementation == impl
        m.load_state_dict(base.state_dict())
        return m.to(DEVICE, dtype)

    return {"ref32": build("sdpa", torch.float32), "sdpa": build("sdpa", torch.float16),
            "tileflash": build(name, torch.float16)}


@pytest.fixture
def calls(monkeypatch):
    """Counts calls into tileflash's attention function, so a silent fallback to another backend fails."""
    seen = []
    original = tf_hf.tileflash_attention_forward

    def counting(*args, **kwargs):
        seen.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(tf_hf, "tileflash_attention_forward", counting)
    tf_hf.register()
    yield seen
    monkeypatch.undo()
    tf_hf.register()


def test_padded_batch_logits_and_greedy_tokens(models, calls):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (3, 13), generator=g).to(DEVICE)
    mask = torch.ones(3, 13, dtype=torch.long, device=DEVICE)
    mask[1, :4] = 0  # left padding, as in batched generation
    mask[2, :9] = 0
    with torch.no_grad():
        logits = {k: m(ids, attention_mask=mask).logits.float() for k, m in models.items()}
        tokens = {k: models[k].generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
                  for k in ("sdpa", "tileflash")}
    assert calls, "the tileflash attention function was never called"
    keep = mask.bool()
    err, bound = error_and_bound(logits["tileflash"][keep], logits["ref32"][keep], logits["sdpa"][keep])
    assert err <= bound, (err, bound)
    assert torch.equal(tokens["tileflash"], tokens["sdpa"])


def test_padding_free_packed_batch(models, calls):
    """Three sequences packed in one row (position_ids restart at 0) equal three separate forwards."""
    g = torch.Generator().manual_seed(2)
    lens = [5, 11, 7]
    seqs = [torch.randint(0, 128, (1, n), generator=g).to(DEVICE) for n in lens]
    packed = torch.cat(seqs, dim=1)
    position_ids = torch.cat([torch.arange(n) for n in lens]).unsqueeze(0).to(DEVICE)
    with torch.no_grad():
        out = models["tileflash"](packed, position_ids=position_ids).logits.float()[0]
        ref32 = torch.cat([models["ref32"](s).logits.float()[0] for s in seqs])
        ref16 = torch.cat([models["sdpa"](s).logits.float()[0] for s in seqs])
    assert calls
    err, bound = error_and_bound(out, ref32, ref16)
    assert err <= bound, (err, bound)


def test_gpt_oss_attention_sinks():
    """gpt-oss passes its per-head sinks as s_aux: a tiny random gpt-oss (sliding and full layers, sinks drawn far
    from zero) gives eager's logits within the 2x rule. transformers sends models that list their own flash kernels
    (gpt-oss does) to those when the name says "flash", so tileflash registers under another name for them."""
    name = tf_hf.register("tileattn")
    cfg = dict(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
               layer_types=["sliding_attention", "full_attention"], max_position_embeddings=256)
    torch.manual_seed(0)
    base = transformers.GptOssForCausalLM(transformers.GptOssConfig(**cfg)).eval()
    with torch.no_grad():
        for layer in base.model.layers:
            layer.self_attn.sinks.uniform_(-2.0, 3.0)

    def build(impl, dtype):
        m = transformers.AutoModelForCausalLM.from_config(transformers.GptOssConfig(**cfg),
                                                          attn_implementation=impl).eval()
        m.load_state_dict(base.state_dict())
        return m.to(DEVICE, dtype)

    ids = torch.randint(0, 128, (2, 21), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    with torch.no_grad():
        logits = {k: build(impl, dt)(ids).logits.float()
                  for k, impl, dt in (("ref32", "eager", torch.float32), ("eager16", "eager", torch.float16),
                                      ("tileflash", name, torch.float16))}
    err, bound = error_and_bound(logits["tileflash"], logits["ref32"], logits["eager16"])
    assert err <= bound, (err, bound)


def test_training_with_attention_dropout(calls):
    """A Llama with attention_dropout > 0 in train mode: transformers passes the dropout to tileflash, which applies
    it (two steps differ, a repeated seed repeats one) and differentiates through it; eval mode has none."""
    name = tf_hf.register()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**CONFIG, attention_dropout=0.3),
                                                          attn_implementation=name).to(DEVICE, torch.float16)
    ids = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(4)).to(DEVICE)

    def step(seed):
        torch.manual_seed(seed)
        return model(ids, labels=ids)

    model.train()
    first, again, other = step(1), step(1), step(2)
    assert torch.equal(first.logits, again.logits) and not torch.equal(first.logits, other.logits)
    first.loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    model.eval()
    with torch.no_grad():
        assert torch.equal(step(1).logits, step(2).logits)
    assert calls
