"""What shipping a fleet's logs costs: PUT requests a second and dollars a day.

A VM with output cuts a chunk every ``chunk_s`` seconds (sooner only past ``chunk_mb`` per
``chunk_s``, 267 KB/s at the defaults); a VM with none puts nothing. So the request rate is
``nodes / chunk_s`` for any fleet whose nodes print at all, and it dominates the bill: the
bytes are small once gzipped."""

from __future__ import annotations

from dataclasses import dataclass

# List prices (USD): S3 Standard PUT, GCS Standard class A operation, per 1,000 requests;
# storage per GB-month.
PUT_USD_PER_1000 = {"s3": 0.005, "gcs": 0.005}
STORAGE_USD_PER_GB_MONTH = {"s3": 0.023, "gcs": 0.020}
# gzip level 6 on step lines full of numbers (loss, lr, tokens/s, one a rank a step): 0.22
# of a 4 MB chunk, 0.25 of a 15 KB one; repeated warnings and tracebacks do better.
GZIP_RATIO = 0.25


@dataclass(frozen=True)
class ShippingCost:
    """One fleet's shipping.

    Attributes:
        puts_per_s: PUT requests a second, the whole fleet.
        put_usd_per_day: what those requests cost a day.
        gb_per_day: compressed GB stored a day.
        storage_usd_per_day: the storage bill a day once 30 days of logs are kept.
    """

    puts_per_s: float
    put_usd_per_day: float
    gb_per_day: float
    storage_usd_per_day: float


def shipping_cost(
    nodes: int,
    *,
    chunk_s: float = 15.0,
    chunk_mb: float = 4.0,
    bytes_per_s: float = 1000.0,
    store: str = "s3",
    keep_days: float = 30.0,
) -> ShippingCost:
    """The cost of ``nodes`` VMs each printing ``bytes_per_s`` (uncompressed) to ``store``
    (``"s3"`` or ``"gcs"``), with chunks of at most ``chunk_s`` seconds and ``chunk_mb`` MB.
    """
    if bytes_per_s <= 0:
        return ShippingCost(0.0, 0.0, 0.0, 0.0)
    chunks_per_s = max(1.0 / chunk_s, bytes_per_s / (chunk_mb * 1e6))
    puts = nodes * chunks_per_s
    gb_day = nodes * bytes_per_s * 86_400 * GZIP_RATIO / 1e9
    return ShippingCost(
        puts_per_s=puts,
        put_usd_per_day=puts * 86_400 * PUT_USD_PER_1000[store] / 1000,
        gb_per_day=gb_day,
        storage_usd_per_day=gb_day * keep_days * STORAGE_USD_PER_GB_MONTH[store] / 30,
    )
