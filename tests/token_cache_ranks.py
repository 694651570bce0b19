"""Each rank of a torchrun launch takes a source's token rows from the cache (used by
tests/test_training_data.py; not a test itself). Prints one line per rank: `rank R tokenized N rows
S` (N: the calls of pack_tokens this process made, S: the rows' sha256).

    torchrun --nproc_per_node W tests/token_cache_ranks.py SOURCE SEQ_LEN
"""

from __future__ import annotations

import hashlib
import os
import sys

from gsm_train.config.schema import DataSourceConfig
from gsm_train.models.model_zoo import byte_tokenizer
from gsm_train.training import token_cache
from gsm_train.training.distributed import init_distributed, teardown

if __name__ == "__main__":
    calls = 0
    pack = token_cache.pack_tokens

    def counted(*args, **kwargs):
        global calls
        calls += 1
        return pack(*args, **kwargs)

    token_cache.pack_tokens = counted
    info = init_distributed()
    rows = token_cache.cached_rows(DataSourceConfig(path=sys.argv[1]), byte_tokenizer(), int(sys.argv[2]), info)
    digest = hashlib.sha256(rows.numpy().tobytes()).hexdigest()
    # one write(2) of a short line: the ranks share a pipe, and print's separate writes of the text
    # and its newline could interleave with another rank's
    os.write(1, f"rank {info.rank} tokenized {calls} rows {digest}\n".encode())
    teardown()
