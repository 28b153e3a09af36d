"""`nanoserve chat [MODEL]`: a conversation in the terminal, on the engine directly (as `ollama run`
or `llama-cli -cnv`). Each turn's reply streams as it is decoded; the history goes back through the
chat template every turn. `/reset` forgets the conversation, `/exit` (or Ctrl-D) ends it, and
Ctrl-C stops a reply between two steps (the program goes on; at the prompt it only clears the line).
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import time

from nanoserve.launch import engine_options, outputs, sampling_params

COMMANDS = "/reset forgets the conversation, /exit ends it; Ctrl-C stops a reply"


def run_chat(args: argparse.Namespace) -> int:
    """Chat with ``args.model`` with the command line's engine and sampling options."""
    options = engine_options(args, args.model)
    from nanoserve.engine import build_engine
    from nanoserve.summary import describe_engine

    params = sampling_params(args)
    started = time.perf_counter()
    with build_engine(args.model, **options) as engine:
        if getattr(engine.tokenizer, "chat_template", None) is None:
            raise ValueError(f"{args.model}: the model has no chat template; give one with --chat-template")
        for line in describe_engine(engine, args.model, time.perf_counter() - started):
            print(f"nanoserve: {line}", file=sys.stderr)
        print(f"nanoserve: {COMMANDS}", file=sys.stderr)
        Conversation(engine, params, args.system).loop()
    return 0


class Conversation:
    """The history (a system message first, when given) and one turn at a time."""

    def __init__(self, engine, params, system: str | None) -> None:
        self.engine, self.params = engine, params
        self.start = [{"role": "system", "content": system}] if system else []
        self.history = list(self.start)
        self._stop = False

    def loop(self) -> None:
        while True:
            try:
                line = input(">>> ").strip()
            except EOFError:
                print()
                return
            except KeyboardInterrupt:  # at the prompt: a fresh line, not the end
                print()
                continue
            if line in ("/exit", "/quit", "/bye"):
                return
            if line == "/reset":
                self.history = list(self.start)
                print("(conversation reset)")
            elif line.startswith("/"):
                print(f"(unknown command {line.split()[0]}: {COMMANDS})")
            elif line:
                self.turn(line)

    def turn(self, text: str) -> None:
        """The user's message, the reply streamed, both kept (a stopped reply as far as it went)."""
        self.history.append({"role": "user", "content": text})
        prompt = self.engine.tokenizer.apply_chat_template(self.history, add_generation_prompt=True)
        self._stop = False
        previous = signal.signal(signal.SIGINT, self._interrupt)
        reply, finished = "", None
        try:
            with contextlib.closing(outputs(self.engine, prompt, self.params)) as replies:  # closed: aborted
                for output in replies:
                    sys.stdout.write(output.new_text)
                    sys.stdout.flush()
                    reply += output.new_text
                    finished = output.finish_reason
                    if self._stop:
                        break
        finally:
            signal.signal(signal.SIGINT, previous)
        print("\n(stopped)" if self._stop else "")
        if finished == "error":
            print("(the reply failed)")
        self.history.append({"role": "assistant", "content": reply})

    def _interrupt(self, signum, frame) -> None:
        self._stop = True  # seen between two steps: the engine is never cut mid-step
