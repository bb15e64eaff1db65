"""Tokenizers (tokenizer.py): a Hugging Face tokenizer's text streamed token by token."""

import pytest

import tokenizer


def test_a_hugging_face_tokenizers_stream_keeps_the_space_its_decoder_takes_from_the_context(corpus):
    tokenizers = pytest.importorskip("tokenizers")
    # SentencePiece-style: a word's leading space is a "▁" that the decoder drops at the start of a text
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace()
    tok.decoder = tokenizers.decoders.Metaspace()
    tok.train_from_iterator(corpus(300).splitlines(), tokenizers.trainers.BpeTrainer(vocab_size=200,
                                                                                     special_tokens=["<unk>"]))
    ours = tokenizer.Tokenizer(dict(tokenizer="hf", tokenizer_json=tok.to_str()))
    prompt, new = ours.encode("LEAR: sweet"), ours.encode(" sorrow, fair lord")
    assert ours.decode(new) != " sorrow, fair lord"  # alone, the first word loses its space
    text = ours.streamer(prompt)
    assert "".join(map(text, new)) + text(None) == " sorrow, fair lord"
