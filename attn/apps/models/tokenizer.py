"""Byte-level BPE (GPT-2 style) from a GGUF file's vocabulary and merges, in pure Python.

The SmolLM2 tokenizer ("smollm" pre-tokenizer): split out special tokens, split
digits one by one, split the rest with GPT-2's regex, map each byte to a
printable character (GPT-2's ``bytes_to_unicode``), then apply the merges in
rank order within each piece.
"""

import functools

import regex

# GPT-2's pre-tokenizer regex (tokenizers' ByteLevel(use_regex=True))
GPT2_SPLIT = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
DIGIT = regex.compile(r"(\p{N})")  # Digits(individual_digits=True)


@functools.lru_cache(maxsize=1)
def bytes_to_unicode():
    """GPT-2's byte -> printable character table (bytes 33..126 etc. map to themselves)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in keep]
    table = {b: chr(b) for b in keep}
    table.update({b: chr(256 + i) for i, b in enumerate(shifted)})
    return table


class BPETokenizer:
    """Encode text to token ids and back.

    Parameters
    ----------
    tokens : list of str
        The vocabulary, id -> token string (byte-level characters).
    merges : list of str
        ``"a b"`` pairs, highest priority first.
    special : list of str
        Tokens matched verbatim in the text before any splitting (e.g. ``<|im_start|>``).
    """

    def __init__(self, tokens, merges, special=()):
        self.tokens = list(tokens)
        self.ids = {t: i for i, t in enumerate(self.tokens)}
        self.ranks = {tuple(m.split(" ", 1)): r for r, m in enumerate(merges)}
        self.byte_char = bytes_to_unicode()
        self.char_byte = {c: b for b, c in self.byte_char.items()}
        self.special = {t: self.ids[t] for t in special}
        alternatives = "|".join(regex.escape(t) for t in sorted(self.special, key=len, reverse=True))
        self.special_split = regex.compile(f"({alternatives})") if self.special else None

    @functools.lru_cache(maxsize=65536)
    def _bpe(self, piece):
        """Merge the characters of one pre-token, lowest merge rank first; return token ids."""
        parts = list(piece)
        while len(parts) > 1:
            pairs = [(self.ranks.get(pair, float("inf")), i) for i, pair in enumerate(zip(parts, parts[1:]))]
            rank, i = min(pairs)
            if rank == float("inf"):
                break
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        return tuple(self.ids[p] for p in parts)

    def encode(self, text):
        """Token ids of ``text`` (list of int); special tokens in the text become their ids."""
        ids = []
        chunks = self.special_split.split(text) if self.special_split else [text]
        for chunk in chunks:
            if chunk in self.special:
                ids.append(self.special[chunk])
                continue
            for part in DIGIT.split(chunk):
                for piece in GPT2_SPLIT.findall(part):
                    ids.extend(self._bpe("".join(self.byte_char[b] for b in piece.encode("utf-8"))))
        return ids

    def decode_bytes(self, ids):
        """The UTF-8 bytes of tokens ``ids`` (special tokens give their text)."""
        out = bytearray()
        for i in ids:
            tok = self.tokens[i]
            out += tok.encode("utf-8") if tok in self.special else bytes(self.char_byte[c] for c in tok)
        return bytes(out)

    def decode(self, ids):
        """Text of tokens ``ids`` (invalid UTF-8 becomes U+FFFD)."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")
