# What gen_server's dispatch adds to a message, against a plain receive loop (issue 19;
# bench/results/erlport-round-trip-continued.md, "The worker process and the Python
# worker, measured"): a ping-pong of N messages with each, the server holding a state
# map of 27 keys as VllmBridge.Worker does and updating one key per message. No port, no
# Python: the cost of the process's framework alone.
#
#   elixir bench/genserver_dispatch.exs [messages rounds]    (defaults 200 000, 5)

defmodule Gs do
  use GenServer

  @impl true
  def init(state), do: {:ok, state}

  @impl true
  def handle_info({:m, from, x}, %{phase: phase} = state) when phase != :ready,
    do: {:noreply, state |> tap(fn _ -> send(from, x) end)}

  def handle_info({:m, from, x}, state) do
    send(from, x)
    {:noreply, %{state | calls: x}}
  end
end

defmodule Plain do
  def loop(state) do
    receive do
      {:m, from, x} ->
        send(from, x)
        loop(%{state | calls: x})
    end
  end
end

[n, rounds] =
  case System.argv() do
    [] -> [200_000, 5]
    [m, r] -> [String.to_integer(m), String.to_integer(r)]
  end

state = Map.new(1..25, &{:"k#{&1}", &1}) |> Map.merge(%{phase: :ready, calls: 0})
{:ok, gs} = GenServer.start_link(Gs, state)
plain = spawn_link(fn -> Plain.loop(state) end)

run = fn pid ->
  t = System.monotonic_time(:nanosecond)

  for i <- 1..n do
    send(pid, {:m, self(), i})

    receive do
      ^i -> :ok
    end
  end

  round((System.monotonic_time(:nanosecond) - t) / n)
end

for _ <- 1..rounds do
  IO.puts("ns per round trip: gen_server #{run.(gs)}, plain receive loop #{run.(plain)}")
end
