"""gpt-oss's chat format, harmony, through openai-harmony: detection of gpt-oss models and
their encoding (model), the encoding's vocabulary derived offline (vocab), prompts
rendered from OpenAI messages (render), completions read into reasoning_content, content
and tool_calls (output), the grammars of forced tool calls and JSON answers
(constraints), and what a chat request needs of them (request)."""
