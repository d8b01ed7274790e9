"""Tokenizers for the sampler-side tests: a tiny byte-level BPE built by hand (instant) and
the embedded SmolLM2 tokenizer rebuilt from the GGUF metadata (about 5 s, once a process)."""

from __future__ import annotations

import functools

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

from tests._embedded_model import embedded_gguf_path

TINY_SPECIALS = ("<eos>", "<stop>")
# Merges that make tokens straddle character boundaries: a space glued to the first byte of
# "€" (E2 82 AC), the last two bytes of "€" as one token, and those two glued to the next
# "€"'s first byte (so "€€€" is [E2] [82 AC E2] [82 AC E2] [82 AC]).
_TINY_MERGES = (
    ("h", "e"),
    ("l", "l"),
    ("he", "ll"),
    ("\u0120", "\u00e2"),
    ("\u0124", "\u00ac"),
    ("\u0124\u00ac", "\u00e2"),
    ("\u0120", "w"),
)


def _byte_level_alphabet() -> list[str]:
    return sorted(pre_tokenizers.ByteLevel.alphabet())


@functools.cache
def tiny_tokenizer() -> Tokenizer:
    """Byte-level BPE over the 256 byte symbols plus a few merges and two special tokens.
    Ids 0 and 1 are `<eos>` and `<stop>`."""
    vocab: dict[str, int] = {token: i for i, token in enumerate(TINY_SPECIALS)}
    for symbol in _byte_level_alphabet():
        vocab[symbol] = len(vocab)
    for left, right in _TINY_MERGES:
        vocab[left + right] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=list(_TINY_MERGES), fuse_unk=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in TINY_SPECIALS]
    )
    return tokenizer


@functools.cache
def tiny_sentencepiece_tokenizer() -> Tokenizer:
    """Llama-2 style: "▁" marks spaces, unknown characters fall back to <0xNN> byte tokens,
    and the decoder strips the text's leading space. Ids 0-2: <unk>, <s>, </s>."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in ("\u2581", "\u2581hello", "\u2581world", "\u2581a", *"abcdehlorw"):
        vocab.setdefault(piece, len(vocab))
    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>", fuse_unk=True)
    )
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
    )
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace("\u2581", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")]
    )
    return tokenizer


def byte_token_id(value: int) -> int:
    """The tiny tokenizer's id for the single byte `value`."""
    symbol = _gpt2_byte_to_symbol()[value]
    token_id = tiny_tokenizer().token_to_id(symbol)
    assert token_id is not None
    return token_id


@functools.cache
def _gpt2_byte_to_symbol() -> dict[int, str]:
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


class ByteLevelTokenBytes:
    """A tokenizers.Tokenizer plus `token_bytes(id)`, as app.tokenizer.Tokenizer offers."""

    def __init__(self, raw: Tokenizer) -> None:
        self.raw = raw
        self._symbol_to_byte = {s: b for b, s in _gpt2_byte_to_symbol().items()}
        self._special_ids = frozenset(raw.get_added_tokens_decoder())

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.raw.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        token = self.raw.id_to_token(token_id)
        assert token is not None
        if token_id in self._special_ids:
            return token.encode()
        return bytes(self._symbol_to_byte[ch] for ch in token)


@functools.cache
def smollm2_tokenizer() -> Tokenizer:
    """The embedded model's tokenizer, built independently of app.tokenizer from the GGUF
    metadata (llama.cpp's `smollm` pre-tokenizer splits digits). Skips the calling test
    where the embedded model is not installed."""
    from gguf import GGUFReader

    reader = GGUFReader(embedded_gguf_path())
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    merges = reader.fields["tokenizer.ggml.merges"].contents()
    token_types = reader.fields["tokenizer.ggml.token_type"].contents()
    tokenizer = Tokenizer(
        models.BPE(
            vocab={t: i for i, t in enumerate(tokens)},
            merges=[tuple(m.split(" ")) for m in merges],
            fuse_unk=False,
        )
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, kind in zip(tokens, token_types)
            if kind == 3
        ]
    )
    return tokenizer
