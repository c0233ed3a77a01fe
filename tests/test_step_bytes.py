"""The byte floors: `ling_jax.bench.step_bytes` for Ling-3.0-flash, part by part, against a count made by hand.

Every performance target is a fraction of these floors, so the count is pinned here independently of the code that
makes it: each part below is a plain integer with its formula from the architecture (docs/model.md §2-§4), never a
call into param_specs. Sizes: D 2560 hidden, H 32 heads, K 128 head dim, W 4 conv taps; 42 layers, every sixth MLA
(35 KDA + 7 MLA), layers 0-1 dense (I 6144), 40 MoE (E 512 experts of Ie 768, top-8, one shared expert of 768);
MLA R 512 + P 64 latent, q 192 + gate per head, k_nope 128, v 128; V 157184. FP8 (the -fp8 layout as ling-jax
stores it, pallas_kernels/common/fp8.py): E4M3 values at 1 byte, float32 scales; projections stored [out, in] keep
one scale per output row and 128 input columns, the experts the checkpoint's 128x128 blocks; embedding, lm_head,
norms, conv taps, A_log, dt_bias, the router (fp32 in the preset) and expert_bias stay as they are. The MTP layer is
no part of the main model's step.

Floors at 4.3 TB/s (HBM_BYTES_PER_S), context 9216 (SGLang's workload: 8192 prompt + 1024 out), batch 1:

    step                         bf16                         FP8
    plain decode (T = 1)         10,539,796,608 B  2.451 ms    5,972,787,584 B  1.389 ms
    verify of 3 drafts (T = 4)   22,087,214,208 B  5.137 ms   11,859,277,184 B  2.758 ms

The 5.97 GB and 1.388 ms of experiments/RESULTS.md's FP8 rows are 5,969,341,824 B (1.3882 ms): this count without
the KDA conv window (35 layers x 4 rows x 24,576 B = 3,440,640 B) and the final norm (5,120 B). The verify step's
floor is twice the plain step's mostly through the MoE: four positions can select 32 distinct experts per layer, not 8.
"""

import pytest

from ling_jax.bench import HBM_BYTES_PER_S, step_bytes
from ling_jax.config import preset

CONTEXT = 9216
FLASH = preset("ling-3.0-flash")

# Per layer, bf16 (compute dtype 2 bytes; fp32 parameters 4).
KDA_BF16 = {
    "w_in": 105_021_440,  # D·H·(5K + 1)·2 = 2560·32·641·2 (q, k, v, f, g, then b per head)
    "conv_qkv": 196_608,  # W·3·H·K·4 = 4·3·32·128·4
    "A_log": 128,  # H·4
    "dt_bias": 16_384,  # H·K·4
    "o_norm": 256,  # K·2
    "w_o": 20_971_520,  # H·K·D·2
    "input_norm + post_norm": 10_240,  # 2·D·2
}
MLA_BF16 = {
    "w_qg": 31_621_120,  # D·H·(192 + 1)·2
    "w_kv_a": 2_949_120,  # D·(R + P)·2 = 2560·576·2
    "kv_a_norm": 1_024,  # R·2
    "w_k_b": 4_194_304,  # R·H·128·2
    "w_v_b": 4_194_304,  # R·H·128·2
    "w_o": 20_971_520,  # H·128·D·2
    "input_norm + post_norm": 10_240,  # 2·D·2
}
DENSE_BF16 = 94_371_840  # 3·D·I·2 = 3·2560·6144·2 (gate, up, down)
EXPERT_BF16 = 11_796_480  # 3·Ie·D·2 = 3·768·2560·2, one routed or the shared expert
ROUTER = 5_242_880  # E·D·4 = 512·2560·4 (fp32 in the preset)
EXPERT_BIAS = 2_048  # E·4

# Per layer, FP8: values at 1 byte plus their float32 scales.
KDA_FP8 = {
    "w_in values": 52_510_720,  # D·H·641
    "w_in scales": 1_640_960,  # H·641·ceil(D/128)·4 = 20512·20·4: one per output row and 128 input columns
    "conv_qkv": 196_608,
    "A_log": 128,
    "dt_bias": 16_384,
    "o_norm": 256,
    "w_o values": 10_485_760,  # H·K·D
    "w_o scales": 327_680,  # D·ceil(H·K/128)·4 = 2560·32·4 (the input is heads x head dim)
    "input_norm + post_norm": 10_240,
}
MLA_FP8 = {
    "w_qg values": 15_810_560,  # D·H·193
    "w_qg scales": 494_080,  # H·193·20·4
    "w_kv_a values": 1_474_560,  # D·576
    "w_kv_a scales": 46_080,  # 576·20·4
    "kv_a_norm": 1_024,
    "w_k_b values": 2_097_152,  # R·H·128
    "w_k_b scales": 65_536,  # H·128·ceil(R/128)·4 = 4096·4·4
    "w_v_b values": 2_097_152,
    "w_v_b scales": 65_536,
    "w_o values": 10_485_760,
    "w_o scales": 327_680,  # 2560·32·4
    "input_norm + post_norm": 10_240,
}
DENSE_FP8 = 48_660_480  # 3·(D·I + 491,520): gate/up scales 6144·20·4, down scales 2560·ceil(6144/128)·4
EXPERT_FP8 = 5_899_680  # 3·(Ie·D + 6·20·4): each matrix's 128x128 blocks, ceil(768/128)·ceil(2560/128)

LM_HEAD = 804_787_200  # D·V·2 = 804,782,080 (bf16 in FP8 too) + the final norm D·2 = 5,120
EMBED_ROW = 5_120  # D·2 per position
KDA_DELTA_STATE = 2_097_152  # H·K·K·4: the fp32 state [32, 128, 128]
CONV_ROW = 24_576  # 3·H·K·2: one position's pre-conv q | k | v
MLA_ROW = 1_152  # (R + P)·2


def hand_count(fp8: bool, positions: int, routed: int) -> dict[str, int]:
    kda, mla = (KDA_FP8, MLA_FP8) if fp8 else (KDA_BF16, MLA_BF16)
    dense, expert = (DENSE_FP8, EXPERT_FP8) if fp8 else (DENSE_BF16, EXPERT_BF16)
    return {
        "lm_head": LM_HEAD,
        "embed_row": positions * EMBED_ROW,
        # Per KDA layer: the delta state read once and each position's post-state written; the conv window's 3 rows
        # read and each position's new row written.
        "kda_state": 35 * ((1 + positions) * KDA_DELTA_STATE + (3 + positions) * CONV_ROW),
        # Per MLA layer: the context's rows, the earlier read and the new written (bf16 in FP8 too).
        "mla_cache": 7 * CONTEXT * MLA_ROW,
        "mixers": 35 * sum(kda.values()) + 7 * sum(mla.values()),
        "ffn": 2 * dense + 40 * (ROUTER + EXPERT_BIAS + (routed + 1) * expert),
    }


CASES = {  # (FP8, positions, distinct routed experts per MoE layer: top-8 per position, all distinct)
    "bf16 plain": (False, 1, 8),
    "FP8 plain": (True, 1, 8),
    "bf16 verify k=3": (False, 4, 32),
    "FP8 verify k=3": (True, 4, 32),
}


@pytest.mark.parametrize("case", CASES)
def test_step_bytes_part_by_part_against_the_hand_count(case):
    fp8, positions, routed = CASES[case]
    cfg = FLASH.replace(quantization="fp8" if fp8 else None)
    got = step_bytes(cfg, CONTEXT, 2, positions=positions)
    want = hand_count(fp8, positions, routed)
    assert set(got) == set(want)
    wrong = {part: (got[part], want[part], got[part] - want[part]) for part in want if got[part] != want[part]}
    assert not wrong, f"{case}: parts as (step_bytes, hand count, difference): {wrong}"


def test_floors_of_the_docstring():
    floors = {case: sum(hand_count(*CASES[case]).values()) for case in CASES}
    assert floors == {"bf16 plain": 10_539_796_608, "FP8 plain": 5_972_787_584,
                      "bf16 verify k=3": 22_087_214_208, "FP8 verify k=3": 11_859_277_184}
    ms = {case: round(b / HBM_BYTES_PER_S * 1e3, 3) for case, b in floors.items()}
    assert ms == {"bf16 plain": 2.451, "FP8 plain": 1.389, "bf16 verify k=3": 5.137, "FP8 verify k=3": 2.758}


def test_a_measured_expert_count_replaces_the_most_the_positions_can_select():
    # A mean as bench_moe.py measures it: ~31 distinct experts at T = 4 under random routing (its T = 4 floor).
    cfg = FLASH.replace(quantization="fp8")
    got = step_bytes(cfg, CONTEXT, 2, positions=4, routed_experts=31.1)
    assert got["ffn"] == pytest.approx(2 * DENSE_FP8 + 40 * (ROUTER + EXPERT_BIAS + 32.1 * EXPERT_FP8), abs=1e-3)
    assert {k: v for k, v in got.items() if k != "ffn"} == {
        k: v for k, v in hand_count(True, 4, 32).items() if k != "ffn"}
