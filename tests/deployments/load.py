"""A bounded load generator for the reliability suite: a mix of OpenAI requests sent by concurrent
clients (the official `openai` client over HTTP), with what each got back and how long it took.

    specs = request_mix(64, seed=0)
    run = run_load(base_url, api_key, "tiny", specs, clients=8)
    print(run.summary())          # requests, failures, p50/p99 latency, TTFT, tokens/s

Each spec is completions or chat, streaming or not, greedy or seeded sampling, sometimes n = 2
and sometimes with a stop string; `Result` keeps every choice's text and finish reason so the
caller can compare greedy outputs with the in-process engine's.
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from dataclasses import dataclass, field

import openai

#: Words of the tiny test vocabulary (w1..w89: w90-w93 are the chat template's role markers).
WORDS = [f"w{i}" for i in range(1, 90)]


@dataclass(frozen=True)
class Spec:
    index: int
    chat: bool
    stream: bool
    prompt: str
    max_tokens: int
    temperature: float = 0.0
    seed: int | None = None
    n: int = 1
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def messages(self) -> list[dict]:
        return [{"role": "system", "content": "w7 w8"}, {"role": "user", "content": self.prompt}]

    def body(self, model: str) -> dict:
        body: dict = {"model": model, "max_tokens": self.max_tokens, "temperature": self.temperature,
                      "n": self.n}
        if self.seed is not None:
            body.update(seed=self.seed, top_p=0.9)
        if self.stop:
            body["stop"] = list(self.stop)
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.chat:
            body["messages"] = self.messages()
        else:
            body["prompt"] = self.prompt
        return body


@dataclass
class Result:
    spec: Spec
    ok: bool = False
    error: str = ""
    status: int | None = None
    latency_s: float = 0.0
    ttft_s: float | None = None  # streams: until the first chunk with text
    texts: dict[int, str] = field(default_factory=dict)  # choice index -> text
    finish_reasons: dict[int, str | None] = field(default_factory=dict)
    completion_tokens: int = 0
    speculative: dict | None = None


def request_mix(count: int, seed: int = 0, min_tokens: int = 4, max_tokens: int = 40,
                stop_words: dict[int, str] | None = None) -> list[Spec]:
    """`count` requests, half greedy; about a third streamed chat, a fifth with n = 2; stop strings where
    `stop_words` (spec index -> word) gives one."""
    rng = random.Random(seed)
    specs = []
    for i in range(count):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12)))
        greedy = i % 2 == 0
        specs.append(Spec(
            index=i, chat=rng.random() < 0.5, stream=rng.random() < 0.5, prompt=prompt,
            max_tokens=rng.randint(min_tokens, max_tokens), temperature=0.0 if greedy else 0.8,
            seed=None if greedy else rng.randint(0, 10_000), n=2 if rng.random() < 0.2 else 1,
            stop=(stop_words[i],) if stop_words and i in stop_words else ()))
    return specs


def send(client: openai.OpenAI, model: str, spec: Spec) -> Result:
    """One request; every outcome (an OpenAI error too) becomes a `Result`."""
    result = Result(spec)
    body = spec.body(model)
    endpoint = client.chat.completions if spec.chat else client.completions
    start = time.perf_counter()
    try:
        if spec.stream:
            stream = endpoint.create(stream=True, stream_options={"include_usage": True}, **body)
            for chunk in stream:
                for choice in chunk.choices:
                    text = (choice.delta.content if spec.chat else choice.text) or ""
                    if text and result.ttft_s is None:
                        result.ttft_s = time.perf_counter() - start
                    result.texts[choice.index] = result.texts.get(choice.index, "") + text
                    if choice.finish_reason is not None:
                        result.finish_reasons[choice.index] = choice.finish_reason
                if chunk.usage is not None:
                    result.completion_tokens = chunk.usage.completion_tokens
                    result.speculative = (chunk.model_extra or {}).get("speculative")
        else:
            response = endpoint.create(**body)
            for choice in response.choices:
                result.texts[choice.index] = choice.message.content if spec.chat else choice.text
                result.finish_reasons[choice.index] = choice.finish_reason
            result.completion_tokens = response.usage.completion_tokens
            result.speculative = (response.model_extra or {}).get("speculative")
        result.ok = True
    except openai.APIStatusError as e:
        result.status, result.error = e.status_code, f"{e.status_code}: {e.message}"
    except Exception as e:  # noqa: BLE001 - reported, never raised: the load goes on
        result.error = f"{e.__class__.__name__}: {e}"
    result.latency_s = time.perf_counter() - start
    return result


@dataclass
class LoadRun:
    results: list[Result]
    wall_s: float
    clients: int

    @property
    def failed(self) -> list[Result]:
        return [r for r in self.results if not r.ok]

    def summary(self, label: str = "load") -> str:
        latencies = [r.latency_s for r in self.results if r.ok]
        ttfts = [r.ttft_s for r in self.results if r.ok and r.ttft_s is not None]
        tokens = sum(r.completion_tokens for r in self.results if r.ok)
        reasons: dict[str, int] = {}
        for r in self.failed:
            reasons[r.error.split(":")[0]] = reasons.get(r.error.split(":")[0], 0) + 1
        return (f"{label}: {len(self.results)} requests from {self.clients} clients, "
                f"{len(self.results) - len(self.failed)} ok, {len(self.failed)} failed {reasons or ''}| "
                f"latency p50 {percentile(latencies, 50):.2f}s p99 {percentile(latencies, 99):.2f}s | "
                f"TTFT (streams) p50 {percentile(ttfts, 50):.3f}s p99 {percentile(ttfts, 99):.3f}s | "
                f"{tokens} tokens in {self.wall_s:.1f}s = {tokens / self.wall_s:.1f} tok/s")


def run_load(base_url: str, api_key: str, model: str, specs: list[Spec], clients: int = 8,
             timeout_s: float = 120.0) -> LoadRun:
    """Send `specs` from `clients` threads (each its own client and connection pool), in order."""
    pending = list(reversed(specs))
    lock = threading.Lock()
    results: list[Result] = []

    def client_loop() -> None:
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=timeout_s)
        while True:
            with lock:
                if not pending:
                    return
                spec = pending.pop()
            result = send(client, model, spec)
            with lock:
                results.append(result)

    start = time.perf_counter()
    threads = [threading.Thread(target=client_loop, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s * len(specs))
    results.sort(key=lambda r: r.spec.index)
    return LoadRun(results, time.perf_counter() - start, clients)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[max(0, min(98, round(q) - 1))]
