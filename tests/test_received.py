"""labkit.spans.received: what each stage's forward received and returned, fingerprinted. An activation (a
tensor that requires grad) is fingerprinted later, where the rank would wait for a peer, at the step's end or
when the record is read: the record then holds exactly what fingerprinting it at once gives."""

from __future__ import annotations

import torch

from labkit.spans import received


class Stage:
    stage_index, is_last = 1, False


def forward(stage, mb, x, out, **kwargs):
    received.begin(stage, mb)
    received.before(stage, (x,), kwargs)
    received.after(stage, out)


def test_activations_are_fingerprinted_later_and_the_record_is_the_same():
    g = torch.Generator().manual_seed(0)
    stage = Stage()
    xs = [torch.randn(4, 8, 16, generator=g).requires_grad_(True) for _ in range(3)]
    masks = [torch.randint(0, 2, (4, 8), generator=g) for _ in range(3)]
    outs = [x * 2 + 1 for x in xs]  # requires grad: its fingerprint waits too
    for mb in range(3):
        forward(stage, mb, xs[mb], outs[mb], mask=masks[mb])
    # the mask (no grad) is taken at once; the activations are due
    assert len(received.PENDING) == 6
    rec = getattr(stage, received.ATTR)
    assert rec[1]["args"][0] is received.DUE and rec[1]["out"] is received.DUE
    assert rec[1]["kwargs"]["mask"][0] == "tensor"
    got = received.of_stages([stage])  # reading settles what is due
    assert received.PENDING == []
    for mb in range(3):
        want = [received.on_host(received.fingerprint(v)) for v in (xs[mb], outs[mb], masks[mb])]
        have = [got[1][mb]["args"][0], got[1][mb]["out"], got[1][mb]["kwargs"]["mask"]]
        for a, b in zip(have, want):
            assert a[:3] == b[:3] and torch.equal(a[3], b[3])  # bit for bit


def test_under_no_grad_and_for_plain_tensors_nothing_waits():
    stage = Stage()
    x = torch.randn(2, 3, requires_grad=True)
    with torch.no_grad():
        forward(stage, 0, x, x * 2)
    forward(stage, 1, torch.randn(2, 3), torch.randn(2, 3))
    assert received.PENDING == []
    rec = getattr(stage, received.ATTR)
    assert all(rec[mb]["args"][0][0] == "tensor" and rec[mb]["out"][0] == "tensor" for mb in (0, 1))


def test_stages_driven_by_hand_never_hold_more_than_the_cap():
    stage = Stage()
    for mb in range(3 * received.MAX_PENDING):
        x = torch.randn(2, 3, requires_grad=True)
        forward(stage, mb, x, x + 1)
        assert len(received.PENDING) <= received.MAX_PENDING
    received.settle()
    assert all(r["args"][0][0] == "tensor" for r in getattr(stage, received.ATTR).values())


def test_the_spans_wait_wrapper_settles_before_a_rank_waits(monkeypatch):
    """Where the rank would wait for a peer (labkit.spans.record's wrapper of torch's wait), the fingerprints
    due are taken first; a call that waits for nothing leaves them due."""
    from labkit.spans import record

    seen = []
    wait = record._wait_wrapper(lambda works: seen.append(len(received.PENDING)))
    stage = Stage()
    x = torch.randn(2, 3, requires_grad=True)
    forward(stage, 0, x, x + 1)
    wait([])
    assert seen == [2]
    wait(["a work"])
    assert seen == [2, 0] and getattr(stage, received.ATTR)[0]["out"][0] == "tensor"
