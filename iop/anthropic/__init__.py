"""Anthropic's Messages API over chat-completions upstreams: the request, the whole answer, the stream, the errors.

Client called /v1/messages, upstream serves chat (see docs/anthropic-compat.md):
    messages_to_chat_request(request, model)   -> the chat request to send upstream (request.py)
    chat_to_messages_answer(body, model)       -> the Messages answer for the client (answer.py)
    ChatToMessagesStream(model)                -> chat SSE bytes in, Messages SSE bytes out (stream.py)
    error_body(exc) / error_event(exc)         -> Anthropic's error shape for any RequestError (errors.py)
"""
