"""One request's live state (`state.Live`): its cache, the tokens in it, the token it feeds next,
how it samples and drafts, and the state it keeps before a possible stop string (`stops.Stops`),
and what a decode batch's pass leaves for its next step (`fed.Fed`). The run that prefills and
decodes it is the engine's (`engine/run.py`, `Run` extends `Stops` with its prefill); a decode
batch (`engine/batch/`) feeds it as a row; speculation (`engine/spec/`) sees it as a
`spec.row.Row`. Imports `engine/spec` and `engine/inpass` only.
"""
