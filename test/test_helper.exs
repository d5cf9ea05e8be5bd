Code.require_file("support/runtime_helpers.exs", __DIR__)
ExUnit.start()
