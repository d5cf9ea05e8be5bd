defmodule VllmBridge.DoctestTest do
  @moduledoc """
  The examples in `VllmBridge`'s docs run as written, against real workers: the
  moduledoc's starts and stops a pool of its own, the functions' use the pool
  `:default`, started here (no other test starts one of that name). Also
  `VllmBridge.Telemetry`'s.
  """
  use ExUnit.Case, async: false

  setup_all do
    {:ok, _} = VllmBridge.start_pool(:default, size: 1)
    on_exit(fn -> VllmBridge.stop_pool(:default) end)
    :ok
  end

  doctest VllmBridge
  # Its examples hold with :telemetry loaded or not (the stand-in of the telemetry tests).
  doctest VllmBridge.Telemetry
end
