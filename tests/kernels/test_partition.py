"""The split-KV heuristic: split only while the GPU is under-filled, never into tiny partitions."""
from kernels.decode import PART_ALIGN, choose_partition


def test_full_gpu_needs_no_split():
    assert choose_partition(8192, num_seqs=64, num_kv_heads=8, num_sms=132) is None


def test_single_long_sequence_splits_into_aligned_partitions():
    part = choose_partition(8192, num_seqs=1, num_kv_heads=8, num_sms=132)
    assert part is not None and part % PART_ALIGN == 0 and part >= 512
    assert -(-8192 // part) <= 2 * 132 // 8 + 1


def test_short_context_is_not_split():
    assert choose_partition(300, num_seqs=1, num_kv_heads=1, num_sms=132) is None
