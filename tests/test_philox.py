"""Philox4x32-10 known answers (Random123 kat_vectors) and the properties the casts rely on."""
import pytest
import torch

from faircast_dist.philox import derive_dither_key, derive_key, philox4x32_10, random_bits16

# Random123 kat_vectors: counter (4 words), key (2 words) -> output (4 words).
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter,key,expected", KAT)
def test_known_answers(counter, key, expected):
    out = philox4x32_10(torch.tensor([counter], dtype=torch.int64), key)
    assert tuple(out[0].tolist()) == expected


def python_philox(ctr, key):
    """Straight from the SC'11 paper with Python ints: the independent reference."""
    (c0, c1, c2, c3), (k0, k1) = ctr, key
    for r in range(10):
        if r:
            k0, k1 = (k0 + 0x9E3779B9) % 2**32, (k1 + 0xBB67AE85) % 2**32
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 % 2**32, (p0 >> 32) ^ c3 ^ k1, p0 % 2**32
    return c0, c1, c2, c3


def test_matches_python_reference_on_random_counters():
    g = torch.Generator().manual_seed(0)
    ctr = torch.randint(0, 2**32, (2000, 4), generator=g, dtype=torch.int64)
    key = (0xDEADBEEF, 0x01234567)
    out = philox4x32_10(ctr, key)
    for row, got in zip(ctr.tolist(), out.tolist()):
        assert tuple(got) == python_philox(row, key)


def test_batch_equals_one_at_a_time():
    g = torch.Generator().manual_seed(0)
    ctr = torch.randint(0, 2**32, (64, 4), generator=g, dtype=torch.int64)
    key = (0x12345678, 0x9ABCDEF0)
    batch = philox4x32_10(ctr, key)
    for i in range(0, 64, 7):
        assert torch.equal(philox4x32_10(ctr[i:i + 1], key)[0], batch[i])


def test_key_is_stable_and_sensitive():
    k = derive_key(1234, 7, "layers.0.mlp.weight")
    # Pinned: the derivation is part of the on-disk contract (resume across versions).
    import hashlib, struct
    payload = b"faircast/philox/v1\0" + struct.pack("<qq", 1234, 7) + b"layers.0.mlp.weight"
    assert k == struct.unpack("<II", hashlib.blake2b(payload, digest_size=8).digest())
    assert len({k, derive_key(1235, 7, "layers.0.mlp.weight"), derive_key(1234, 8, "layers.0.mlp.weight"),
                derive_key(1234, 7, "layers.1.mlp.weight")}) == 4
    with pytest.raises(TypeError, match="name must be a str"):
        derive_key(1, 2, 3)


def test_dither_key_is_stable_stepless_and_not_a_step_key():
    k = derive_dither_key(1234, "layers.0.mlp.weight")
    import hashlib, struct
    payload = b"faircast/dither/v1\0" + struct.pack("<q", 1234) + b"layers.0.mlp.weight"
    assert k == struct.unpack("<II", hashlib.blake2b(payload, digest_size=8).digest())  # pinned
    assert len({k, derive_dither_key(1235, "layers.0.mlp.weight"), derive_dither_key(1234, "layers.1.mlp.weight")}) == 3
    assert k not in {derive_key(1234, step, "layers.0.mlp.weight") for step in range(1000)}
    with pytest.raises(TypeError, match="name must be a str"):
        derive_dither_key(1, 3)


def test_bits_depend_only_on_index():
    key = derive_key(0, 0, "w")
    whole = random_bits16(key, 0, numel=1000)
    assert whole.dtype == torch.int32 and int(whole.min()) >= 0 and int(whole.max()) < 2**16
    # Any contiguous run, any index tensor (permuted, strided) gives the same bits per index.
    assert torch.equal(random_bits16(key, 333, numel=101), whole[333:434])
    perm = torch.randperm(1000, generator=torch.Generator().manual_seed(1))
    assert torch.equal(random_bits16(key, perm), whole[perm])
    strided = torch.arange(5, 1000, 13).view(-1, 1)
    assert torch.equal(random_bits16(key, strided), whole[strided])


def test_bits_uniform_and_independent():
    n = 1 << 18
    a = random_bits16(derive_key(9, 0, "w"), 0, numel=n).double() / 2**16
    b = random_bits16(derive_key(9, 1, "w"), 0, numel=n).double() / 2**16  # next step
    tol = 5 / n**0.5  # 5 sigma for a correlation / centred mean of n uniforms
    assert abs(a.mean().item() - 0.5) < tol * 0.29  # sd of U(0,1) is 0.289
    assert abs(a.var().item() - 1 / 12) < 0.002
    for x, y in [(a, b), (a[:-1], a[1:]), (a[:-8], a[8:])]:  # across steps, neighbours, blocks
        assert abs(torch.corrcoef(torch.stack([x, y]))[0, 1].item()) < tol
    # each of the 16 bits is fair
    ints = (a * 2**16).long()
    for bit in range(16):
        assert abs(((ints >> bit) & 1).double().mean().item() - 0.5) < 5 * 0.5 / n**0.5


def test_errors():
    key = derive_key(0, 0, "w")
    with pytest.raises(ValueError, match="numel is required"):
        random_bits16(key, 3)
    with pytest.raises(ValueError, match="negative"):
        random_bits16(key, torch.tensor([-1, 2]))
