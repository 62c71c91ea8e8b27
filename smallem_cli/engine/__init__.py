"""The engine: many sequences decoded together over one shared page pool, or one alone
(`generate.stream` runs a batch of one: one loop for both).

request.py    what a user asks for (Request) and what comes back (Finished)
sequence.py   a request being decoded: its tokens, cache length, generator, stats
pool.py       the plain-Python page allocator every sequence and cache shares
batch.py      one pass's flat inputs: ids, positions, slots, gather slots, mask
forward.py    the target / draft / MTP pass over a flattened batch (native where on, else eager)
proposers.py  batched proposers: none, ngram, draft, mtp
runner.py     one round over the batch: propose, verify pass, verify, keep
scheduler.py  admit, preempt, finish: `Engine.run(requests)`; k by load
build.py      an engine for a loaded target and a named proposer
"""
