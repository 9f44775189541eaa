"""The block drafter's module (decode/spec/heads/block.py): context rows outside the window
are never read, the block's rows see each other (bidirectional) but not beyond the context, the
export folds the training-time scales exactly, and training fits a fixed batch."""
import torch

from bench.spec_training.losses import block_losses
from decode.spec.heads.block import BlockConfig, BlockDrafter, load_block_drafter, save_block_drafter
from decode.spec.heads.eagle import TargetParts

H, V = 64, 97


def _drafter(seed: int = 0) -> BlockDrafter:
    cfg = BlockConfig(hidden_size=H, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      vocab_size=V, block_size=5, context=6, feature_layers=(0, 1, 2), draft_vocab_size=V,
                      emb_scale=2.0)
    d = BlockDrafter(cfg, torch.arange(V))
    d.init_weights(seed, std=0.1)
    return d


def _target() -> TargetParts:
    g = torch.Generator().manual_seed(3)
    return TargetParts(torch.randn(V, H, generator=g), torch.ones(H), torch.randn(V, H, generator=g), 1e-5)


def _inputs(B: int = 3):
    g = torch.Generator().manual_seed(5)
    return (torch.randint(0, V, (B,), generator=g), torch.randn(B, 6, 3 * H, generator=g),
            torch.tensor([6, 2, 1]), torch.tensor([40, 9, 3]))


def _run(d, tp, first, feats, ctx_len, pos):
    return d(lambda ids: torch.nn.functional.embedding(ids, tp.embed), first, d.fused(feats), ctx_len, pos)


def test_rows_outside_the_window_are_never_read():
    d, tp = _drafter(), _target()
    first, feats, ctx_len, pos = _inputs()
    out = _run(d, tp, first, feats, ctx_len, pos)
    garbage = feats.clone()
    garbage[1, :4] = 1e3                   # row 1 reads its last 2 rows only, row 2 its last one
    garbage[2, :5] = -7.0
    assert torch.equal(_run(d, tp, first, garbage, ctx_len, pos), out)
    changed = feats.clone()
    changed[1, 5] += 1.0                   # ... and it does read those
    assert not torch.allclose(_run(d, tp, first, changed, ctx_len, pos)[1], out[1])


def test_the_pending_token_reaches_every_row_of_the_block():
    d, tp = _drafter(), _target()
    first, feats, ctx_len, pos = _inputs()
    out = _run(d, tp, first, feats, ctx_len, pos)
    other = _run(d, tp, (first + 1) % V, feats, ctx_len, pos)
    assert all(not torch.allclose(out[:, i], other[:, i]) for i in range(5))


def test_the_export_folds_the_depth_scales(tmp_path):
    d, tp = _drafter(), _target()
    with torch.no_grad():
        d.depth_scale.copy_(torch.tensor([0.5, 3.0, 11.0]))
    save_block_drafter(d, str(tmp_path), "toy", "fp")
    back = load_block_drafter(str(tmp_path))
    first, feats, ctx_len, pos = _inputs()
    assert torch.equal(back.d2t, d.d2t)
    # bf16 weights on export: close, not equal
    torch.testing.assert_close(_run(back, tp, first, feats, ctx_len, pos), _run(d, tp, first, feats, ctx_len, pos),
                               atol=0.1, rtol=0.05)


def test_training_fits_a_fixed_batch():
    torch.manual_seed(0)
    d, tp = _drafter(), _target()
    first, feats, ctx_len, pos = _inputs()
    labels = torch.randint(0, V, (3, 5), generator=torch.Generator().manual_seed(9))
    labels[2, 3:] = -100                   # past the sequence's end
    opt = torch.optim.Adam(d.parameters(), lr=1e-2)
    start = float(block_losses(d, tp, tp.lm_head, first, feats, ctx_len, pos, labels, 0.8)[0].detach())
    for _ in range(60):
        loss, _ = block_losses(d, tp, tp.lm_head, first, feats, ctx_len, pos, labels, 0.8)
        opt.zero_grad()
        loss.backward()
        opt.step()
    loss, accs = block_losses(d, tp, tp.lm_head, first, feats, ctx_len, pos, labels, 0.8)
    # from chance (1 in 97) to most rows right
    assert float(loss.detach()) < 0.05 * start and sum(accs) / len(accs) > 0.75, (start, float(loss.detach()), accs)
