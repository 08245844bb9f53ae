import pytest

from scheduler.quantities import format_bytes, format_seconds, parse_bytes

PARSE_CASES = [
    ("1024", 1024),
    ("1", 1),
    ("1.5e9", 1_500_000_000),
    ("1E3", 1000),
    ("512MB", 512_000_000),
    ("512mb", 512_000_000),
    ("6GiB", 6 * 1024**3),
    ("2 GiB", 2 * 1024**3),
    ("  2 GiB  ", 2 * 1024**3),
    ("100KiB", 102_400),
    ("1kB", 1000),
    ("1KB", 1000),
    ("1.5 GiB", 1_610_612_736),
    ("0.5KiB", 512),
    ("3TB", 3_000_000_000_000),
    ("1TiB", 1_099_511_627_776),
    ("12B", 12),
    ("12 b", 12),
    (".5MB", 500_000),
    ("2.5", 2),  # rounds half to even
    ("3.5", 4),
]


@pytest.mark.parametrize(("text", "expected"), PARSE_CASES)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


BAD_CASES = [
    "",
    "   ",
    "abc",
    "GiB",
    "-1",
    "-2GiB",
    "0",
    "0 MiB",
    "0.1",  # rounds to zero bytes
    "6G",  # ambiguous
    "6 gigabytes",
    "6 GiB GiB",
    "1,024",
    "nan",
    "inf",
    "1e",
]


@pytest.mark.parametrize("text", BAD_CASES)
def test_parse_bytes_rejects(text):
    with pytest.raises(ValueError) as info:
        parse_bytes(text)
    message = str(info.value)
    assert repr(text) in message
    assert "GiB" in message and "1.5e9" in message  # names the accepted forms


def test_parse_bytes_ambiguous_unit_says_what_to_write():
    with pytest.raises(ValueError, match=r"'GB' for 1000-based or 'GiB' for 1024-based"):
        parse_bytes("6g")


def test_parse_bytes_rejects_non_string():
    with pytest.raises(ValueError):
        parse_bytes(1024)  # type: ignore[arg-type]


FORMAT_CASES = [
    (0, "0 B"),
    (12, "12 B"),
    (1023, "1023 B"),
    (1024, "1.00 KiB"),
    (1536, "1.50 KiB"),
    (512 * 1024**2, "512.00 MiB"),
    (1024**3, "1.00 GiB"),
    (1_610_612_736, "1.50 GiB"),
    (1024**2 - 1, "1.00 MiB"),  # not "1024.00 KiB"
    (5 * 1024**4, "5.00 TiB"),
    (3 * 1024**5, "3.00 PiB"),
    (2048 * 1024**5, "2048.00 PiB"),
    (-1536, "-1.50 KiB"),
    (-12, "-12 B"),
]


@pytest.mark.parametrize(("n", "expected"), FORMAT_CASES)
def test_format_bytes(n, expected):
    assert format_bytes(n) == expected


@pytest.mark.parametrize("text", ["1024", "512 MiB", "6GiB", "100KiB", "1TiB"])
def test_format_then_parse_round_trips_exact_iec_values(text):
    n = parse_bytes(text)
    assert parse_bytes(format_bytes(n).replace(" ", "")) == n


SECONDS_CASES = [
    (0.0, "0 us"),
    (0.00085, "850 us"),
    (0.0123, "12.3 ms"),
    (1.25, "1.25 s"),
    (125.0, "2 min 5.0 s"),
    (-0.0123, "-12.3 ms"),
]


@pytest.mark.parametrize(("seconds", "expected"), SECONDS_CASES)
def test_format_seconds(seconds, expected):
    assert format_seconds(seconds) == expected
