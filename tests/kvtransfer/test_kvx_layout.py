import pytest
import torch

from pdserve.kvtransfer import KVLayout, KVTransferError
from pdserve.kvtransfer import layout as wire
from pdserve.kvtransfer.layout import MsgKind, WireHeader, check_handshake, pack_hello, unpack_header, unpack_layout


def caches(layers=2, blocks=5, bs=4, heads=2, dim=8, dtype=torch.float32):
    return [(torch.zeros(blocks, bs, heads, dim, dtype=dtype), torch.zeros(blocks, bs, heads, dim, dtype=dtype))
            for _ in range(layers)]


def test_layout_from_caches():
    layout = KVLayout.from_caches(caches(layers=3, dtype=torch.bfloat16))
    assert layout == KVLayout(3, 4, 2, 8, "bfloat16")
    assert layout.block_bytes == 4 * 2 * 8 * 2
    assert layout.layer_message_bytes(5) == 2 * 5 * 128
    assert layout.fingerprint == KVLayout(3, 4, 2, 8, "bfloat16").fingerprint
    assert layout.fingerprint != KVLayout(3, 4, 2, 8, "float16").fingerprint


def test_layout_rejects_bad_caches():
    with pytest.raises(ValueError, match="empty"):
        KVLayout.from_caches([])
    bad = caches()
    bad[1] = (bad[1][0], torch.zeros(5, 4, 2, 9))
    with pytest.raises(ValueError, match=r"kv_caches\[1\] V"):
        KVLayout.from_caches(bad)
    with pytest.raises(ValueError, match="contiguous"):
        KVLayout.from_caches([(torch.zeros(5, 8, 2, 4).transpose(1, 3), torch.zeros(5, 4, 2, 8))])
    with pytest.raises(ValueError, match="head_dim"):
        KVLayout(1, 4, 2, 0, "float32")
    with pytest.raises(ValueError, match="dtype"):
        KVLayout(1, 4, 2, 8, "float64")


def test_header_roundtrip():
    header = WireHeader(MsgKind.LAYER, transfer_key=0xDEADBEEF12345678, layer=7, num_blocks=3,
                        num_bytes=3 * 2 * 256, fingerprint=0x0123456789ABCDEF, status=0)
    raw = header.pack()
    assert len(raw) == wire.HEADER_BYTES == 48
    back = unpack_header(raw, expected_fingerprint=0x0123456789ABCDEF)
    assert back == WireHeader(MsgKind.LAYER, 0xDEADBEEF12345678, 7, 3, 1536, 0x0123456789ABCDEF, 0, wire.WIRE_VERSION)


def test_header_version_mismatch(monkeypatch):
    raw = WireHeader(MsgKind.LAYER, 1).pack()
    monkeypatch.setattr(wire, "WIRE_VERSION", wire.WIRE_VERSION + 1)
    mine = wire.WIRE_VERSION - 1
    with pytest.raises(KVTransferError,
                       match=f"wire version mismatch: peer speaks {mine}, this process speaks {mine + 1}"):
        unpack_header(raw)
    assert unpack_header(raw, check_version=False).version == mine


def test_header_layout_mismatch_and_garbage():
    raw = WireHeader(MsgKind.LAYER, 1, fingerprint=5).pack()
    with pytest.raises(KVTransferError, match="fingerprint mismatch"):
        unpack_header(raw, expected_fingerprint=6)
    with pytest.raises(KVTransferError, match="magic"):
        unpack_header(b"\0" * 48)
    with pytest.raises(KVTransferError, match="short"):
        unpack_header(raw[:20])


def test_handshake_checks_layout_and_version(monkeypatch):
    local = KVLayout(2, 4, 2, 8, "float32")
    peer = KVLayout(2, 4, 2, 16, "float32")
    hello = pack_hello(MsgKind.HELLO, peer)
    header = unpack_header(hello)
    with pytest.raises(KVTransferError, match="layout mismatch.*head_dim=16"):
        check_handshake(local, header, unpack_layout(hello[wire.HEADER_BYTES:]))
    same = pack_hello(MsgKind.HELLO, local)
    check_handshake(local, unpack_header(same), unpack_layout(same[wire.HEADER_BYTES:]))
    monkeypatch.setattr(wire, "WIRE_VERSION", 9)
    with pytest.raises(KVTransferError, match="version mismatch"):
        check_handshake(local, unpack_header(same, check_version=False), local)


def test_handshake_names_every_mismatch(monkeypatch):
    local = KVLayout(2, 16, 2, 8, "bfloat16")
    peer = KVLayout(2, 32, 2, 8, "float16")
    hello = pack_hello(MsgKind.HELLO, peer, model="org/other-model")
    header = unpack_header(hello)
    assert wire.hello_model(hello, header) == "org/other-model"
    with pytest.raises(KVTransferError) as info:
        check_handshake(local, header, unpack_layout(hello[wire.HEADER_BYTES:]), "org/model",
                        wire.hello_model(hello, header))
    text = str(info.value)
    assert "model mismatch: peer serves 'org/other-model', this process 'org/model'" in text
    assert "dtype=float16 (local dtype=bfloat16)" in text and "block_size=32 (local block_size=16)" in text
    # a model stated on one side only is not checked; the same model and layout pass
    same = pack_hello(MsgKind.HELLO, local, model="org/model", extra=b"xyz")
    h = unpack_header(same)
    check_handshake(local, h, local, "", wire.hello_model(same, h))
    check_handshake(local, h, local, "org/model", wire.hello_model(same, h))
    assert wire.hello_extra(same, h) == b"xyz"
    monkeypatch.setattr(wire, "WIRE_VERSION", 9)
    with pytest.raises(KVTransferError, match="wire version mismatch: peer speaks 4, this process speaks 9"):
        check_handshake(local, unpack_header(same, check_version=False), local, "org/model", "org/model")


def test_payload_checksum_catches_a_flipped_bit():
    import torch

    data = torch.randint(0, 256, (4096,), dtype=torch.uint8)
    crc = wire.payload_checksum(data)
    data[1234] ^= 1
    assert wire.payload_checksum(data) != crc
