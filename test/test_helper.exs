Code.require_file("support/runtime_helpers.exs", __DIR__)
Code.require_file("support/stream_context_case.exs", __DIR__)
ExUnit.start()
