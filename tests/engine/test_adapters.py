"""refit_verify.engine.adapters: zero checks, region digests, slot fingerprints and the per-worker
ledger of verified adapters (no vLLM: plain tensors stand in for LoRA slots)."""

from __future__ import annotations

import torch

from refit_verify.digest.batch import tensor_digest
from refit_verify.engine.adapters import AdapterLedger, check_regions, index_map, nonzero, outside, selection, slot_fingerprint


def test_nonzero_sees_any_byte_and_negative_zero():
    t = torch.zeros(4, 8, dtype=torch.bfloat16)
    assert not nonzero(t) and not nonzero(t[:0])
    t[1, 3] = -0.0
    assert nonzero(t) and nonzero(t[:, 2:]) and not nonzero(t[:, 4:])
    assert nonzero(torch.tensor([0.0, 1e-30], dtype=torch.float32))
    assert not nonzero(torch.zeros(3, dtype=torch.float64))


def test_outside_is_everything_but_the_block():
    m = torch.arange(24.0).reshape(4, 6)
    below, right = outside(m, 2, 5)
    assert below.shape == (2, 6) and right.shape == (2, 1)
    assert below.numel() + right.numel() + 2 * 5 == m.numel()


def test_selection_reads_rows_columns_and_concatenations_from_an_index_map():
    m = index_map([6, 4])
    assert m.dtype == torch.int64 and m[2, 3].item() == 2 * 4 + 3
    assert selection(m, [6, 4]) is None
    assert selection(m[2:4], [6, 4]) == (0, [(2, 4)])
    assert selection(m[:, 1:3], [6, 4]) == (1, [(1, 3)])
    assert selection(torch.cat([m[0:2], m[4:6]]), [6, 4]) == (0, [(0, 2), (4, 6)])
    assert selection(torch.cat([m[1:2], m[1:2]]), [6, 4]) == (0, [(1, 2), (1, 2)])  # a row taken twice (replicated)


def test_selection_names_what_it_cannot_say():
    m = index_map([6, 4])
    assert "empty" in selection(m[6:], [6, 4])
    assert "both rows and columns" in selection(m[1:3, 0:2], [6, 4])
    assert "not a selection of rows and columns" in selection(m.t().contiguous()[:4, :4], [6, 4])
    assert "no 2-D index tensor" in selection(m.float(), [6, 4])


def test_check_regions_digests_regions_and_names_padding_and_uncovered_areas():
    slot_a = torch.zeros(8, 16, dtype=torch.bfloat16)
    a = torch.randn(4, 16).to(torch.bfloat16)
    slot_a[:4] = a
    other = torch.zeros(8, 16, dtype=torch.bfloat16)
    chk = check_regions({"x.lora_A.weight": slot_a[:4, :16]}, {"pad": outside(slot_a, 4, 16)}, {"k": other})
    assert chk.digests == {"x.lora_A.weight": tensor_digest(a)} and chk.padding == [] and chk.unexpected == {}
    assert chk.proven_bytes == 4 * 16 * 2
    slot_a[6, 0] = 1.0
    other[0, 0] = 2.0
    chk = check_regions({"x.lora_A.weight": slot_a[:4, :16]}, {"pad": outside(slot_a, 4, 16)}, {"k": other})
    assert chk.padding == ["pad"] and list(chk.unexpected) == ["k"]


def test_slot_fingerprint_is_by_content_not_by_slot():
    stacked = torch.zeros(2, 8, 16)
    stacked[0, :4] = 1.5
    stacked[1, :4] = 1.5
    assert slot_fingerprint({"a": stacked[0]}) == slot_fingerprint({"a": stacked[1]})
    stacked[1, 7, 15] = 1.0
    assert slot_fingerprint({"a": stacked[0]}) != slot_fingerprint({"a": stacked[1]})
    assert slot_fingerprint({"a": stacked[0]}) != slot_fingerprint({"b": stacked[0]})


def test_ledger_names_stale_versions_old_bytes_and_replacements():
    led = AdapterLedger()
    assert led.judge(1, 5, "f1", ok=True) == [] and led.get(1) is None
    led.record(1, 5, "f1")
    assert led.get(1) == (5, "f1") and led.verified() == {1: 5}
    (stale,) = led.judge(1, 3, "f0", ok=True)
    assert "version 3 of adapter 1 is older than version 5" in stale
    (old,) = led.judge(1, 6, "f1", ok=False)
    assert "still holds the bytes verified at version 5" in old and "version 6 did not replace them" in old
    (swapped,) = led.judge(1, 5, "f2", ok=False)
    assert "replaced under the same id" in swapped
    assert led.judge(1, 6, "f2", ok=False) == []  # holds neither: the byte comparison names it
    assert led.judge(1, 5, "f1", ok=True) == []  # a repeat of the version verified


def test_ledger_audit_names_never_verified_and_changed_adapters():
    led = AdapterLedger()
    led.record(1, 2, "f1")
    never, changed, problems = led.audit({1: "f1", 4: "f4"})
    assert never == [4] and changed == [] and len(problems) == 1 and "adapter 4 is active" in problems[0]
    never, changed, problems = led.audit({1: "g"})
    assert never == [] and changed == [1] and "other bytes than the ones verified at version 2" in problems[0]


def test_ledger_keeps_what_an_adapter_verified_in_no_slot_expected_until_its_slot_is_known():
    led = AdapterLedger()
    led.record(3, 7, None, expected=({"a": ("d" * 32, [4, 8])}, {}))
    assert led.expectation(3) == (7, ({"a": ("d" * 32, [4, 8])}, {}))
    led.record(3, 7, "f3", expected=({"a": ("d" * 32, [4, 8])}, {}))  # verified in a slot: its fingerprint is enough
    assert led.expectation(3) is None and led.get(3) == (7, "f3")
    led.record(5, 1, None)
    assert led.expectation(5) is None and led.expectation(9) is None


def test_ledger_audit_names_an_active_adapter_whose_last_verification_failed():
    led = AdapterLedger()
    led.record(7, 3, "f3")
    led.fail(7, 4)  # the push of version 4 left version 3's bytes: it failed
    never, changed, problems = led.audit({7: "f3"})
    assert never == [] and changed == [7] and "its last verification (version 4) failed" in problems[0]
    assert led.audit({7: "f3"}, skip=[7]) == ([], [], [])
    led.record(7, 4, "f4")  # a verification that passes clears it
    assert led.audit({7: "f4"}) == ([], [], [])
