"""What the gateway knows of the served model: its name in the API, the checkpoint's
tokenizer (for chat prompts, echo, logprob tokens, /tokenize and /detokenize), its chat
template and its context length. Read from the scheduler's ``inspect`` once a worker
has registered, so the gateway always describes the checkpoint the scheduler serves."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tokenizers import Tokenizer

from expeditor.gateway.chat import ChatTemplate, load_chat_template
from expeditor.gateway.protocol import GatewayRequestError
from ipc.schema import InspectReply
from shared.checkpoint import checkpoint_max_len
from shared.tokenizer import encode_ids, load_tokenizer

__all__ = ["ServedModel"]

TOKEN_TEXT_CACHE = 65_536
"""Token id -> text entries kept for logprobs (a vocabulary is usually smaller)."""


@dataclass
class ServedModel:
    name: str
    path: str
    tokenizer: Tokenizer
    chat_template: ChatTemplate | None
    max_model_len: int | None
    created: int = field(default_factory=lambda: int(time.time()))
    _token_texts: dict[int, str] = field(default_factory=dict)

    @classmethod
    def from_inspect(
        cls, reply: InspectReply, served_name: str, chat_template_file: str
    ) -> ServedModel:
        """The model the scheduler serves: the gateway reads the checkpoint's tokenizer
        (:func:`shared.tokenizer.load_tokenizer`, as the scheduler does) at the same path."""
        path = reply.model
        tokenizer = load_tokenizer(path)
        max_len = reply.config.get("max_model_len")
        if not isinstance(max_len, int):
            max_len = checkpoint_max_len(path)
        return cls(
            name=served_name or path,
            path=path,
            tokenizer=tokenizer,
            chat_template=load_chat_template(path, chat_template_file or None),
            max_model_len=max_len,
        )

    def template(self) -> ChatTemplate:
        """The chat template; a 400 naming the way out when the checkpoint has none."""
        if self.chat_template is None:
            raise GatewayRequestError(
                f"messages: {self.path} has no chat template; start the gateway with "
                "--chat-template FILE",
                param="messages",
            )
        return self.chat_template

    def token_text(self, token_id: int) -> str:
        """The text of one token decoded alone (special tokens included)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._token_texts) < TOKEN_TEXT_CACHE:
                self._token_texts[token_id] = text
        return text

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """Token ids of ``text`` (:func:`shared.tokenizer.encode_ids`: the GIL released, so
        a long text encoded on a thread does not stall the event loop)."""
        return encode_ids(self.tokenizer, text, add_special_tokens=add_special_tokens)

    def encode_text(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens (a bad word's)."""
        return self.encode(text, add_special_tokens=False)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

    def decode_batch(self, batch: list[list[int]]) -> list[str]:
        """Several texts at once (releases the GIL while it works: for a thread)."""
        return self.tokenizer.decode_batch(batch, skip_special_tokens=False)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)
