"""The bucket wire format: plan, pack, copy out and the JSON header (no engine needed)."""

from __future__ import annotations

import json

import pytest
import torch
from dist_helpers import needs_gpus

from titan_lora.transfer.buckets import ALIGN, Entry, bucket_size, copy_out, entry_for, layout_id, pack, plan_buckets


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.f32": torch.randn(3, 5, generator=g),  # 60 bytes: not a multiple of ALIGN
        "b.bf16": torch.randn(7, generator=g).to(torch.bfloat16),  # 14 bytes
        "c.f16": torch.randn(2, 3, 4, generator=g).to(torch.float16),
        "d.big": torch.randn(64, 64, generator=g),  # 16 KiB: larger than the bucket below
        "e.transposed": torch.randn(6, 4, generator=g).t(),  # non-contiguous source
        "f.scalar": torch.tensor(3.5),
        "g.f32": torch.randn(10, generator=g),
    }


def _round_trip(tensors: dict[str, torch.Tensor], bucket_bytes: int) -> tuple[list[list[Entry]], dict]:
    plan = plan_buckets(tensors, bucket_bytes)
    received: dict[str, torch.Tensor] = {}
    for entries in plan:
        # The receiver reads the header as JSON, as it does across the process boundary.
        header = json.loads(json.dumps([e.to_json() for e in entries]))
        buffer = torch.empty(bucket_size(entries), dtype=torch.uint8)
        pack(buffer, entries, tensors)
        _, got = copy_out(buffer, [Entry.from_json(row) for row in header])
        buffer.fill_(0xFF)  # the sender reuses the buffer: what was unpacked must not change
        received.update(got)
    return plan, received


def test_round_trip_mixed_dtypes_big_tensor_and_alignment() -> None:
    tensors = _tensors()
    bucket_bytes = 1024
    plan, received = _round_trip(tensors, bucket_bytes)

    assert list(received) == list(tensors), "every tensor arrives once, in order"
    for name, sent in tensors.items():
        got = received[name]
        assert got.dtype == sent.dtype and got.shape == sent.shape, name
        assert torch.equal(got, sent), f"{name} changed in transit"

    names = [e.name for entries in plan for e in entries]
    assert names == list(tensors), "buckets keep the tensors' order and hold each exactly once"
    for entries in plan:
        assert all(e.offset % ALIGN == 0 for e in entries), "every tensor starts on an ALIGN boundary"
        spans = sorted((e.offset, e.offset + e.nbytes) for e in entries)
        assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:])), "tensors overlap"
        if len(entries) > 1:
            assert bucket_size(entries) <= bucket_bytes, "a shared bucket stays within bucket_bytes"
    big = [entries for entries in plan if any(e.name == "d.big" for e in entries)]
    assert len(big) == 1 and len(big[0]) == 1, "a tensor larger than a bucket gets a bucket of its own"
    assert bucket_size(big[0]) == 64 * 64 * 4
    assert len(plan) >= 3


def test_one_bucket_when_everything_fits() -> None:
    tensors = _tensors()
    plan, received = _round_trip(tensors, 1 << 20)
    assert len(plan) == 1
    assert all(torch.equal(received[k], v) for k, v in tensors.items())


def test_exact_fit_does_not_spill() -> None:
    # Two 64-byte tensors fill a 128-byte bucket exactly; a third goes to the next bucket.
    tensors = {f"t{i}": torch.full((16,), float(i)) for i in range(3)}
    plan = plan_buckets(tensors, 128)
    assert [[e.name for e in b] for b in plan] == [["t0", "t1"], ["t2"]]
    assert [e.offset for e in plan[0]] == [0, 64]


def test_empty_input_has_no_buckets() -> None:
    assert plan_buckets({}, 1024) == []


def test_header_json_round_trip() -> None:
    entry = Entry("base_model.model.x.lora_A.weight", (8, 576), "bfloat16", 128, 8 * 576 * 2)
    row = json.loads(json.dumps(entry.to_json()))
    assert row == {"name": entry.name, "shape": [8, 576], "dtype": "bfloat16", "offset": 128,
                   "nbytes": 9216}
    assert Entry.from_json(row) == entry


@pytest.mark.parametrize("dtype", [torch.float64, torch.int64, torch.uint8])
def test_unsupported_dtype_is_refused_when_planning(dtype: torch.dtype) -> None:
    tensors = {"ok": torch.zeros(4), "bad.tensor": torch.zeros(4, dtype=dtype)}
    with pytest.raises(ValueError, match=r"bad\.tensor.*" + str(dtype).removeprefix("torch.")):
        plan_buckets(tensors, 1024)


def test_unsupported_dtype_is_refused_in_a_header() -> None:
    row = Entry("x", (2,), "float32", 0, 8).to_json() | {"dtype": "float64"}
    with pytest.raises(ValueError, match="unsupported dtype 'float64'"):
        Entry.from_json(row)


def _views_of_one_storage(sizes: list[int], gaps: list[int]) -> dict[str, torch.Tensor]:
    """fp32 tensors that are views into one flat storage, `gaps[i]` floats before tensor i."""
    flat = torch.randn(sum(sizes) + sum(gaps), generator=torch.Generator().manual_seed(1))
    out, pos = {}, 0
    for i, (n, gap) in enumerate(zip(sizes, gaps)):
        pos += gap
        out[f"v{i}"] = flat[pos : pos + n].view(n // 2, 2) if n % 2 == 0 else flat[pos : pos + n]
        pos += n
    return out


def test_round_trip_of_views_at_the_bucket_offsets() -> None:
    # Laid out exactly as plan_buckets places them (ALIGN-aligned, as the gatherer's output is):
    # the packer may copy the whole run at once; the bytes must still arrive exactly.
    sizes = [10, 16, 3, 32]  # floats; 40, 64, 12, 128 bytes
    gaps = [0, (64 - 40) // 4, 0, (64 - 12) // 4]
    tensors = _views_of_one_storage(sizes, gaps)
    plan = plan_buckets(tensors, 1 << 20)
    assert [e.offset for e in plan[0]] == [0, 64, 128, 192]
    _, received = _round_trip(tensors, 1 << 20)
    assert all(torch.equal(received[k], v) for k, v in tensors.items())


def test_round_trip_of_views_not_at_the_bucket_offsets() -> None:
    # One storage, but packed back to back (no alignment): the bucket offsets differ from the
    # storage offsets, so a whole-run copy would scramble them.
    tensors = _views_of_one_storage([10, 16, 3, 32], [0, 0, 0, 0])
    for bucket_bytes in (1 << 20, 100):  # one bucket, and several
        _, received = _round_trip(tensors, bucket_bytes)
        assert all(torch.equal(received[k], v) for k, v in tensors.items()), bucket_bytes


def test_round_trip_of_a_later_bucket_of_one_storage() -> None:
    # Views at aligned offsets split over several buckets: each bucket's own offsets restart at 0.
    sizes = [16, 16, 16, 16, 16]  # 64 bytes each, so aligned back to back
    tensors = _views_of_one_storage(sizes, [0] * 5)
    plan, received = _round_trip(tensors, 128)
    assert [[e.offset for e in b] for b in plan] == [[0, 64], [0, 64], [0]]
    assert all(torch.equal(received[k], v) for k, v in tensors.items())


def test_bucket_checksum_sees_every_byte_and_its_position():
    from titan_lora.transfer.buckets import bucket_checksum

    data = torch.randint(0, 256, (3 * 8192 + 100,), dtype=torch.uint8)
    reference = bucket_checksum(data)
    assert bucket_checksum(data.clone()) == reference
    for pos in (0, 8191, 8192 + 5, 3 * 8192 + 99):  # first, chunk edge, middle, last byte of the tail
        flipped = data.clone()
        flipped[pos] ^= 1
        assert bucket_checksum(flipped) != reference, pos
    swapped = data.clone()
    swapped[:8192], swapped[8192:16384] = data[8192:16384], data[:8192]  # two chunks trade places
    assert bucket_checksum(swapped) != reference
    assert bucket_checksum(data[:-1]) != reference  # length counts
    # an unaligned view (a bucket 1 byte in) is handled
    assert bucket_checksum(data[1:]) == bucket_checksum(data[1:].clone())


# ---- exact values: the checksum and layout ids against independent re-computations --------------------


def _reference_checksum(data: bytes) -> str:
    """bucket_checksum written again from its definition, in plain Python: sums (mod 2**64) of
    little-endian 64-bit words per 8 KiB chunk, then of the remaining words, then of the remaining bytes;
    the digest is the sum of those sums and their sum weighted by ((position + 1) * 0x9E3779B97F4A7C15) | 1,
    both mod 2**64."""
    mask = 2**64 - 1

    def words_sum(chunk: bytes) -> int:
        return sum(int.from_bytes(chunk[i : i + 8], "little") for i in range(0, len(chunk), 8)) & mask

    chunk = 1024 * 8
    full = len(data) // chunk
    sums = [words_sum(data[k * chunk : (k + 1) * chunk]) for k in range(full)]
    rest = data[full * chunk :]
    if rest:
        whole = len(rest) // 8 * 8
        sums += [words_sum(rest[:whole]), sum(rest[whole:])]
    weights = [((k + 1) * 0x9E3779B97F4A7C15 & mask) | 1 for k in range(len(sums))]
    plain = sum(sums) & mask
    weighted = sum(s * w for s, w in zip(sums, weights)) & mask
    return f"w64:{plain:016x}{weighted:016x}:{len(data)}"


@pytest.mark.parametrize("n", [0, 5, 8, 8 * 1024, 2 * 8192 + 8 * 9 + 5, 20000])
def test_bucket_checksum_equals_its_definition(n: int) -> None:
    from titan_lora.transfer.buckets import bucket_checksum

    data = (torch.arange(n, dtype=torch.int64) * 2654435761 % 251).to(torch.uint8)
    assert bucket_checksum(data) == _reference_checksum(bytes(data.tolist()))


@pytest.mark.parametrize("offset", [1, 9, 16])
def test_bucket_checksum_of_an_unaligned_view(offset: int) -> None:
    from titan_lora.transfer.buckets import bucket_checksum

    base = (torch.arange(9000, dtype=torch.int64) % 253).to(torch.uint8)
    view = base[offset:]
    assert bucket_checksum(view) == _reference_checksum(bytes(view.tolist()))


def test_layout_id_is_a_16_hex_digest_of_names_shapes_dtypes_offsets() -> None:
    import hashlib

    from titan_lora.transfer.buckets import layout_id

    entries = [Entry("a", (2, 3), "float32", 0, 24), Entry("b", (5,), "bfloat16", 64, 10)]
    text = "a:(2, 3):float32:0|b:(5,):bfloat16:64"
    assert layout_id(entries) == hashlib.sha1(text.encode()).hexdigest()[:16]


def test_an_empty_bucket_has_size_zero() -> None:
    assert bucket_size([]) == 0


def test_an_unknown_layout_is_named() -> None:
    from titan_lora.transfer.buckets import LayoutCache, UnknownLayout

    with pytest.raises(UnknownLayout) as err:
        LayoutCache().resolve("abc123", None)
    assert err.value.args == ("unknown bucket layout abc123",)


def test_a_non_contiguous_view_in_the_same_storage_is_packed_by_value() -> None:
    from titan_lora.transfer.buckets import one_run

    storage = torch.arange(32, dtype=torch.float32)
    square = storage[16:32].view(4, 4).t()  # same storage, at the bucket offset, but transposed
    tensors = {"a": storage[:16], "b": square}
    (entries,) = plan_buckets(tensors, 1 << 20)
    assert entries[1].offset == 64 and one_run(entries, tensors) is None
    buf = torch.zeros(bucket_size(entries), dtype=torch.uint8)
    pack(buf, entries, tensors)
    assert torch.equal(copy_out(buf, entries)[1]["b"], square)


def test_a_run_lies_on_the_tensors_device() -> None:
    from titan_lora.transfer.buckets import one_run

    storage = torch.empty(32, dtype=torch.float32, device="meta")
    tensors = {"a": storage[:16], "b": storage[16:]}
    (entries,) = plan_buckets(tensors, 1 << 20)
    run = one_run(entries, tensors)
    assert run is not None and run.device.type == "meta" and run.numel() == 128


@needs_gpus(1)
def test_on_gpu_the_graphed_checksum_reads_the_buffer_live_and_equals_its_definition() -> None:
    from titan_lora.transfer.buckets import bucket_checksum

    gen = torch.Generator().manual_seed(5)
    host = torch.randint(0, 256, (3 * 8192 + 8 * 7 + 3,), dtype=torch.uint8, generator=gen)
    buf = host.cuda()
    for view in (buf, buf[:8192], buf[1:]):  # the same storage: each address and size its own graph
        assert bucket_checksum(view) == _reference_checksum(bytes(view.cpu().tolist()))
    first = bucket_checksum(buf)
    for pos in (0, 8192 + 5, buf.numel() - 1):  # new bytes at the captured address: replays see them
        buf[pos] ^= 1
        assert bucket_checksum(buf) == _reference_checksum(bytes(buf.cpu().tolist())) != first, pos
        buf[pos] ^= 1
    assert bucket_checksum(buf) == first


def test_every_checksum_weights_table_stays_alive_for_the_graphs_that_read_it(monkeypatch) -> None:
    """A captured checksum graph reads its weights by address: a table replaced by a larger one (a larger
    bucket came) must not be freed and its memory reused under the graph."""
    from titan_lora.transfer import buckets

    monkeypatch.setattr(buckets, "_WEIGHTS", {})  # as in a fresh process: earlier tests made tables
    monkeypatch.setattr(buckets, "_KEPT", [])
    small = buckets._chunk_weights(3, torch.device("cpu"))
    address = small.untyped_storage().data_ptr()
    larger = buckets._chunk_weights(1 << 12, torch.device("cpu"))
    assert larger.untyped_storage().data_ptr() != address
    assert any(t.untyped_storage().data_ptr() == address for t in buckets._KEPT), "the first table was let go"
    golden = buckets._GOLDEN
    assert torch.equal(larger[:3], (torch.arange(1, 4, dtype=torch.int64) * golden) | 1)


def _header(names: str, offset: int = 0) -> tuple[str, list[dict]]:
    entries = [entry_for(n, torch.zeros(2, 4), offset + 64 * i) for i, n in enumerate(names)]
    return layout_id(entries), [e.to_json() for e in entries]


def test_a_header_is_kept_only_under_the_layout_id_it_hashes_to() -> None:
    from titan_lora.transfer.buckets import LayoutCache, UnknownLayout

    cache = LayoutCache()
    ab, header_ab = _header("ab")
    cd, header_cd = _header("cd")
    with pytest.raises(ValueError, match=f"the bucket header is layout {cd}, the request names {ab}"):
        cache.resolve(ab, header_cd)
    with pytest.raises(UnknownLayout):
        cache.resolve(ab, None)  # the refused header was not kept under the id it named
    first = cache.resolve(ab, header_ab)
    shifted = [{**row, "nbytes": row["nbytes"] * 2} for row in header_ab]  # same id: the id omits nbytes
    with pytest.raises(ValueError, match="do not fit shape"):
        cache.resolve(ab, shifted)
    assert cache.resolve(ab, None) == first, "the first header of a layout stays"


def test_the_layout_cache_is_bounded_and_drops_the_least_recently_used() -> None:
    from titan_lora.transfer.buckets import LayoutCache, UnknownLayout

    cache = LayoutCache(max_entries=4)  # two layouts of two entries
    layouts = [_header(pair) for pair in ("ab", "cd", "ef")]
    cache.resolve(*layouts[0])
    cache.resolve(*layouts[1])
    cache.resolve(layouts[0][0], None)  # used again: the other one is the oldest now
    cache.resolve(*layouts[2])
    with pytest.raises(UnknownLayout):
        cache.resolve(layouts[1][0], None)
    assert [e.name for e in cache.resolve(layouts[0][0], None)] == ["a", "b"]
    with pytest.raises(ValueError, match="at most 4 entries"):
        cache.resolve(*_header("vwxyz"))
