defmodule VllmBridge.Runtime.ShmFailedCallTest do
  @moduledoc """
  Failed calls with large tensor arguments hand their argument slots back (docs/PROTOCOL.md,
  "Tensors in slots", "Lifetimes"). The worker keeps a failed call's exception for a
  later `exit` (the last 64 of each session); through its traceback's frames it kept the
  call's arguments too, so a failed call's argument slot stayed held (`e-<n>.held-<os
  pid>`) for as long as the exception was kept, and 8 failed calls held every argument
  slot of the BEAM: every large tensor after them took the pipe, and their pages stayed.
  Generated orders of failing calls (the shapes of python/tests/bridge/journal_support.py,
  in the default session and in one of their own) and successful ones, on a real worker.
  Not async: it looks at the node's slot directory, which every test's tensors share.
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log

  import VllmBridge.RuntimeHelpers

  alias VllmBridge.{Error, Session, Shm}

  @pool :rt_shm_failed
  @hows ["raise", "nested", "from", "in_except", "through_generator"]

  setup_all do
    start_pool!(@pool,
      size: 1,
      allow: ["journal_support", "vllm_bridge.bridge.diag"],
      worker_env: [python_path([python_support_dir()])]
    )

    :ok
  end

  defp ls(dir), do: dir |> File.ls!() |> Enum.sort()

  test "failed calls with large arguments hand their argument slots back (generated orders)" do
    %{path: dir} = Shm.dir()
    await_idle!(@pool)
    {:ok, s} = Session.open(pool_name: @pool)
    on_exit(fn -> Session.close(s) end)
    seed = :rand.uniform(1_000_000_000)
    :rand.seed(:exsss, {seed, 19, 2})

    # More failures than the BEAM has argument slots (8), whatever the order.
    script =
      for _ <- 1..14 do
        opts = Enum.random([[], [session_id: s.id]])

        if :rand.uniform(4) == 1,
          do: {:echo, opts},
          else: {:fail, Enum.random(@hows), Enum.random(0..2), opts}
      end

    script = [{:fail, "raise", 0, []} | script] ++ List.duplicate({:fail, "nested", 1, []}, 8)
    what = "seed #{seed}: #{inspect(script)}"

    for {step, i} <- Enum.with_index(script) do
      t = filled_tensor(2, i)

      case step do
        {:echo, opts} ->
          assert {:ok, ^t} =
                   VllmBridge.call(
                     {"vllm_bridge.bridge.diag", "echo"},
                     [t],
                     %{},
                     [pool_name: @pool] ++ opts
                   ),
                 what

        {:fail, how, depth, opts} ->
          assert {:error, %Error{type: :python_exception, python_type: python_type}} =
                   VllmBridge.call(
                     {"journal_support", "fail"},
                     [t, how, depth],
                     %{},
                     [pool_name: @pool] ++ opts
                   ),
                 what

          assert python_type =~ "Failure", what
      end
    end

    # Every argument slot comes back (a bounded wait: the worker hands a slot back just
    # after its reply), and a large tensor gets a slot again, not the pipe.
    wait_until(
      fn -> not Enum.any?(ls(dir), &(&1 =~ ~r/\Ae-\d+\.held-/)) end,
      15_000,
      "no argument slot held (#{what}): #{inspect(ls(dir))}"
    )

    big = filled_tensor(2, 99)
    assert {:ok, _name} = Shm.scope(fn -> true end, fn -> Shm.put(big.data) end), what
  end
end
