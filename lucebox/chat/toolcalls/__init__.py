"""Tool calls recognised in the model's streamed answer text.

Modules: `schema` (declared tools, parameter values by schema), `json_scan`
(the incremental JSON checker), `reader` (the base every format's reader
shares), one module per call format (`qwen_xml`, `hermes_json`, `gemma`,
`python_calls`), `regions` (markers, and which format a region holds) and
`driver` (ToolCallParser, with its state table).

Recognised forms (API.md, "Tools"):

1. Qwen3 / coder XML, with or without the `<tool_call>` wrapper::

       <tool_call>
       <function=get_weather>
       <parameter=city>
       Paris
       </parameter>
       </function>
       </tool_call>

2. Hermes JSON: `<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>`
   (`"parameters"` is accepted for `"arguments"`, and arguments given as a JSON string are decoded).
3. A bare JSON call object, or a JSON list of them, when the answer starts with it.
4. `<tool_code>…</tool_code>` and Markdown fences "```tool_code … ```" (Google's
   Gemma function-calling guide has the model wrap calls in these), holding a
   JSON call, a Gemma call, or Python-style calls `get_weather(city="Paris")`
   (one per line, or a list).
5. Gemma's `call:get_weather{city:<escape>Paris<escape>}`, bare or wrapped in
   FunctionGemma's `<start_function_call>` … `<end_function_call>`, and Gemma 4's
   `<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>`.
6. Gemma 3's documented prompt format `[get_weather(city="Paris"), …]` when the
   answer starts with it (only when it begins with `[` + a declared tool + `(`).

Parameter values of the XML, Gemma and Python forms are converted with the
tool's JSON schema (`schema.convert_param`); the JSON forms keep the model's JSON as
written. The markers must reach this parser as text: the detokenizer must not
drop them as special tokens.

Streaming rules:

- Text that might be the start of a marker is held back until it is decided.
- A call *commits* (ToolCallStart) as soon as its name is known and the tool is
  declared. Anything that fails before that — an undeclared tool, text that is
  not a call after all — is released as TextDelta of exactly the original text.
- Arguments stream as they arrive: the XML and Gemma forms emit one piece per
  finished parameter (`{"city": "Paris"`, `, "days": 3`, `}`), and string
  parameters of the XML form stream their text while it is written; the JSON
  forms stream the model's own arguments text, checked by an incremental JSON
  validator and cut only where the text so far can still be closed. (Python
  calls, and JSON calls whose arguments come before the name, are emitted
  whole once read.)
- A committed call that breaks later (bad JSON, output ends inside it) cannot be
  taken back: it is closed with the shortest text that makes its arguments valid
  JSON (`"`, `}`, `]`), and the raw text that the arguments do not hold goes
  back into the text stream. So every ToolCallStart gets a ToolCallEnd whose
  arguments are valid JSON and equal the concatenated ArgsDelta pieces, and no
  output text is lost.
- Whitespace between text and a call, between calls and after the last call is
  dropped (a lone "\\n" text block confuses clients).
"""

from lucebox.chat.toolcalls.driver import ToolCallParser
from lucebox.chat.toolcalls.schema import convert_param, normalize_tools

__all__ = ["ToolCallParser", "convert_param", "normalize_tools"]
