defmodule VllmBridge.Worker.OsProcess do
  @moduledoc false
  # The OS processes of one worker, as this side knows them, and their end (Linux
  # `/proc`). A process is known by its pid and its start time (`/proc/<pid>/stat`
  # field 22, clock ticks since boot), read when it is first seen: a pid alone could name
  # a stranger once the process has exited and the kernel handed its pid to another.
  # Nothing is ever signalled but a process still of the start time recorded.
  #
  #   * `port`: the port's own process (the interpreter, exec'd by the launch script, or
  #     a `python:` wrapper), read as the port opens;
  #   * `group`: its process group: the BEAM's erl_child_setup makes each port's process
  #     a session and group leader (group number: its pid), and a child the wrapper
  #     forks stays in that group after the wrapper has exited;
  #   * `python`: the pid the worker's hello announced (`python/2`), once taken: the
  #     port's process, one of its descendants, or a process of its group started no
  #     earlier than the port (`since`: the port's process's start time, or, when that
  #     process was gone before it could be read (a `python:` wrapper that forks and
  #     exits at once), the clock read just before the port opened) while the group's
  #     number is not another process's pid. A pid is not handed out again while any
  #     process has it as its group (Linux frees a pid once no task uses it as pid,
  #     group or session), so while the wrapper's child is in the group, no process can
  #     hold that number but the wrapper itself: a live process of that pid that is not
  #     the port's recorded one means the group was emptied and its number reused, and
  #     the hello is refused. Left out: a reused number whose new leader also exited
  #     while its group lives on, all between the port's opening and the hello (it
  #     takes the kernel's pid counter going round meanwhile).
  #
  # The kill (`kill_worker/1`) signals the group while one of the known processes is
  # still in it (a group's number is not handed out again while the group has a member,
  # so while one of ours is in it the group is ours), or, when none is, while the group
  # has members by the rule `python/2` takes a hello's pid by (started no earlier than
  # `since`, the group's number no other process's pid) and, once a hello named a
  # process, that process was of the group's session (`held`): the child of a wrapper
  # that never said hello, a process the interpreter started that outlived it. Then
  # each known process outside the group. `gone?/1` waits for those members too. Left
  # out: a process that left the group (it could not be told from a stranger's), and a
  # group number reused by a group whose new leader also exited, all between the last
  # process of the worker's session going and the check (before a hello, within the
  # start's timeout; after it, within the worker's end): the kernel's pid counter
  # would have to go round meanwhile. What remains is the moment between the check of
  # a process and its signal (milliseconds: the pid would have to be handed out again
  # meanwhile).

  require Logger

  alias VllmBridge.Error

  defstruct port: nil, python: nil, group: nil, since: nil, held: false

  # `held`: whether the hello's process is of the group's session (its session's number is
  # the group's), which keeps that number taken while it lives. Without it (an
  # interpreter a wrapper started with `setsid`), the number is free once the wrapper
  # and the group's other members are gone, maybe long before the worker ends, and the
  # group's members are never signalled: a stranger's group could have that number by
  # then (members/1).

  # USER_HZ, the unit of /proc's start times: 100 on x86 and arm (alpha's 1024 is not a
  # platform this library runs on).
  @ticks 100

  @typedoc "A process: its pid and its start time (clock ticks since boot)."
  @type ident :: {pos_integer(), non_neg_integer()}

  @typedoc "A worker's processes (see the moduledoc)."
  @type t :: %__MODULE__{
          port: ident() | nil,
          python: ident() | nil,
          group: pos_integer() | nil,
          since: non_neg_integer() | nil,
          held: boolean()
        }

  @doc """
  The processes of a port just opened, whose OS process is `os_pid` (nil: none known);
  `opened_at` is `now/0` read before the port opened. Its group is taken to be `os_pid`
  (it may not have made it yet): a group of that number can only be one that process
  made, and the group is only signalled by the rules of the moduledoc. When the port's
  process is gone already (a wrapper that forked the interpreter and exited at once, on
  a loaded machine), its group is still known, and `opened_at` stands in for its start
  time.
  """
  @spec spawned(integer() | nil, non_neg_integer() | nil) :: t()
  def spawned(os_pid, opened_at \\ nil) do
    case stat(os_pid) do
      {:ok, %{start: start}} ->
        %__MODULE__{port: {os_pid, start}, group: os_pid, since: start}

      :error when is_integer(os_pid) and os_pid > 1 and is_integer(opened_at) ->
        %__MODULE__{group: os_pid, since: opened_at}

      :error ->
        %__MODULE__{}
    end
  end

  @doc """
  The time now in the clock of a process's start time (`/proc/<pid>/stat` field 22:
  clock ticks since boot, 100 a second), rounded down: a process started after this
  call has a start time no smaller. Read from `/proc/uptime` (hundredths of a second);
  nil where that is not the boot clock (it reads earlier than the BEAM's own start).
  """
  @spec now() :: non_neg_integer() | nil
  def now do
    with {:ok, text} <- File.read("/proc/uptime"),
         [whole, frac | _] <- String.split(text, [".", " "]),
         {whole, ""} <- Integer.parse(whole),
         {frac, ""} <- Integer.parse(frac),
         now = whole * @ticks + div(frac * @ticks, 100),
         # Where /proc/uptime is not the boot clock (lxcfs gives a container's own
         # uptime), it reads earlier than the BEAM's own start: no clock, then.
         {:ok, %{start: beam}} when now >= beam <- stat(String.to_integer(System.pid())) do
      now
    else
      _ -> nil
    end
  end

  @doc """
  Takes `pid`, the pid a worker's hello announced, when it is the port's process, one of
  its descendants (while the port's process is still the one spawned), or a process of
  its group started no earlier than `since` (the port's process's start time, or the
  clock read before the port opened), while the group's number is the pid of no process
  but the port's recorded one (see the moduledoc): `{:ok, t}` with `python` set, else
  `:error`.
  """
  @spec python(t(), term()) :: {:ok, t()} | :error
  def python(%__MODULE__{group: group, since: since} = t, pid)
      when is_integer(group) and is_integer(since) do
    with {:ok, %{start: start, pgrp: pgrp, session: session}} <- stat(pid),
         true <-
           own_descendant?(t.port, pid) or
             (pgrp == group and start >= since and group_ours?(t)) do
      {:ok, %{t | python: {pid, start}, held: session == group}}
    else
      _ -> :error
    end
  end

  def python(%__MODULE__{}, _pid), do: :error

  defp own_descendant?({port_pid, _} = port, pid), do: descendant?(pid, port_pid) and same?(port)
  defp own_descendant?(nil, _pid), do: false

  # The group's number is no process's pid (its leader, the port's process, is gone and
  # reaped), or is still the port's recorded process (alive, or a zombie not yet reaped).
  defp group_ours?(%__MODULE__{group: group, port: port}) do
    case stat(group) do
      :error -> true
      {:ok, %{start: start}} -> port == {group, start}
    end
  end

  @doc "The identity of the process `pid` now (`{pid, start time}`), nil when there is none."
  @spec ident(term()) :: ident() | nil
  def ident(pid) do
    case stat(pid) do
      {:ok, %{start: start}} -> {pid, start}
      :error -> nil
    end
  end

  @doc "The pid to name the worker's Python process by in words: the hello's, else the port's."
  @spec label(t()) :: integer() | nil
  def label(%__MODULE__{python: {pid, _}}), do: pid
  def label(%__MODULE__{port: {pid, _}}), do: pid
  def label(%__MODULE__{}), do: nil

  @doc """
  The worker's processes still there (zombies count as gone): its known ones, and the
  members of its group started no earlier than `since` while the group is ours (a child
  of a `python:` wrapper that never said hello, a process the interpreter started that
  outlived it). Their pids, known ones first.
  """
  @spec remaining(t()) :: [pos_integer()]
  def remaining(%__MODULE__{port: port, python: python} = t) do
    known = for {pid, _} = p <- Enum.uniq([python, port]), same?(p), do: pid
    known ++ (Enum.map(members(t), &elem(&1, 0)) -- known)
  end

  @doc "Pids (`remaining/1`'s) in words, for a log: `\"os pids 12, 34\"`, or `\"none by now\"`."
  @spec pids_text([pos_integer()]) :: String.t()
  def pids_text([]), do: "none by now"
  def pids_text(pids), do: "os pids " <> Enum.map_join(pids, ", ", &Integer.to_string/1)

  @doc "Whether none of the worker's processes is left (`remaining/1` is empty)."
  @spec gone?(t()) :: boolean()
  def gone?(%__MODULE__{} = t), do: known_gone?(t) and members(t) == []

  @doc "Waits up to `ms` for `gone?/1`; true when it holds."
  @spec await_gone(t(), non_neg_integer()) :: boolean()
  def await_gone(t, ms) do
    deadline = System.monotonic_time(:millisecond) + ms
    VllmBridge.Await.until(fn -> known_gone?(t) end, ms, 10) and members_gone?(t, deadline)
  end

  @doc "Whether the port's process and the hello's are gone (members aside: `gone?/1`)."
  @spec known_gone?(t()) :: boolean()
  def known_gone?(%__MODULE__{port: port, python: python}),
    do: not (same?(python) or same?(port))

  # The group's members are looked for only once the known processes are gone, and
  # those found are then watched by themselves until they go (and the group scanned
  # again): a scan of /proc takes milliseconds (2-4 ms for 66 processes), a look at one
  # process microseconds.
  defp members_gone?(t, deadline) do
    case members(t) do
      [] ->
        true

      found ->
        left = deadline - System.monotonic_time(:millisecond)

        left > 0 and VllmBridge.Await.until(fn -> not Enum.any?(found, &same?/1) end, left, 10) and
          members_gone?(t, deadline)
    end
  end

  @doc """
  Kills a worker's processes with SIGKILL: its group while one of its known processes is
  in it or, with none, while it has members of the worker's (`remaining/1`), and each
  known process outside it (see the moduledoc). A process that is not the one recorded
  (another start time, or none) is never signalled.
  """
  @spec kill_worker(t()) :: :ok
  def kill_worker(%__MODULE__{group: group} = t) do
    live =
      for {pid, start} <- Enum.uniq(Enum.reject([t.python, t.port], &is_nil/1)),
          {:ok, %{start: ^start, zombie: false, pgrp: pgrp}} <- [stat(pid)],
          do: {pid, pgrp}

    # With no known process in the group, the group is still signalled when it has
    # members of ours (members/1): the start time and group checks are made there.
    in_group =
      group != nil and
        (Enum.any?(live, fn {_pid, pgrp} -> pgrp == group end) or members(t) != [])

    if in_group, do: kill_group(group)
    for {pid, pgrp} <- live, not (in_group and pgrp == group), do: kill(pid)
    :ok
  end

  @doc "Kills process group `group` with SIGKILL (refused as `kill/1` refuses a pid)."
  @spec kill_group(term()) :: :ok | {:error, Error.t()}
  def kill_group(group) do
    with :ok <- check_pid(group) do
      System.cmd("kill", ["-KILL", "--", "-#{group}"], stderr_to_stdout: true)
      :ok
    end
  end

  @doc """
  Sends SIGKILL to the process `pid` if it is still the one that started at `start`
  (clock ticks since boot); else refuses, naming both start times, and signals nothing.
  """
  @spec kill(term(), non_neg_integer()) :: :ok | {:error, Error.t()}
  def kill(pid, start) do
    case stat(pid) do
      {:ok, %{start: ^start}} ->
        kill(pid)

      found ->
        now = with {:ok, %{start: s}} <- found, do: "started at #{s}"

        {:error,
         Error.new(
           :bad_argument,
           "refusing to kill os pid #{inspect(pid)}: the process recorded started at " <>
             "#{start} (clock ticks since boot), the one there now " <>
             if(now == :error, do: "is none", else: now)
         )}
    end
  end

  @doc """
  Sends SIGKILL to an OS process. Refuses (an error naming the pid, logged) anything but
  a pid above 1, and the BEAM's own: `kill -KILL -1` would kill every process of the
  user, 0 the BEAM's process group.
  """
  @spec kill(term()) :: :ok | {:error, Error.t()}
  def kill(os_pid) do
    with :ok <- check_pid(os_pid) do
      System.cmd("kill", ["-KILL", Integer.to_string(os_pid)], stderr_to_stdout: true)
      :ok
    end
  end

  defp check_pid(os_pid) do
    beam = beam_os_pid()

    if is_integer(os_pid) and os_pid > 1 and os_pid != beam and os_pid != beam_group(beam) do
      :ok
    else
      e =
        Error.new(
          :bad_argument,
          "refusing to kill os pid #{inspect(os_pid)}: only a worker's own process " <>
            "(a pid above 1, not the BEAM's #{beam} nor its group) is killed"
        )

      Logger.error("vllm_bridge: #{e.message}")
      {:error, e}
    end
  end

  defp beam_os_pid, do: String.to_integer(System.pid())

  defp beam_group(beam) do
    case stat(beam) do
      {:ok, %{pgrp: pgrp}} -> pgrp
      :error -> nil
    end
  end

  # Parents followed at most (a chain longer than this is not a wrapper's).
  @max_depth 64

  @doc """
  Whether OS process `pid` is `ancestor` or one of its descendants, by the chain of
  parents in Linux `/proc/<pid>/stat` (false when a process on the way is gone, or
  either pid is not above 1).
  """
  @spec descendant?(term(), term()) :: boolean()
  def descendant?(pid, ancestor)
      when is_integer(pid) and is_integer(ancestor) and pid > 1 and ancestor > 1,
      do: descends(pid, ancestor, @max_depth)

  def descendant?(_pid, _ancestor), do: false

  defp descends(pid, pid, _depth), do: true
  defp descends(pid, _ancestor, depth) when pid <= 1 or depth == 0, do: false

  defp descends(pid, ancestor, depth) do
    case stat(pid) do
      {:ok, %{ppid: ppid}} -> descends(ppid, ancestor, depth - 1)
      :error -> false
    end
  end

  @doc "Whether an OS process exists and is not a zombie (Linux `/proc`)."
  @spec alive?(term()) :: boolean()
  def alive?(os_pid), do: match?({:ok, %{zombie: false}}, stat(os_pid))

  @doc "Waits up to `ms` for an OS process to be gone; true when it is."
  @spec await_exit(non_neg_integer(), non_neg_integer()) :: boolean()
  def await_exit(os_pid, ms), do: VllmBridge.Await.until(fn -> not alive?(os_pid) end, ms, 10)

  # The group's members that are not zombies and started no earlier than `since`, while
  # the group is ours (group_ours?/1) and, once the hello named a process, that process
  # kept the group's number taken (`held`, above): `{pid, start}` each, by a scan of
  # /proc (milliseconds; made only when a worker ends).
  defp members(%__MODULE__{python: {_, _}, held: false}), do: []

  defp members(%__MODULE__{group: group, since: since} = t)
       when is_integer(group) and is_integer(since) do
    with true <- group_ours?(t), {:ok, names} <- :prim_file.list_dir(~c"/proc") do
      for name <- names,
          {pid, []} <- [:string.to_integer(name)],
          {:ok, %{pgrp: ^group, start: start, zombie: false}} <- [stat(pid)],
          start >= since,
          do: {pid, start}
    else
      _ -> []
    end
  end

  defp members(%__MODULE__{}), do: []

  # Whether the process `{pid, start}` is still there, that very one, and not a zombie.
  defp same?({pid, start}), do: match?({:ok, %{start: ^start, zombie: false}}, stat(pid))
  defp same?(nil), do: false

  # What /proc/<pid>/stat says of `pid`: its parent, group, session and start time, and
  # whether it is a zombie. The fields follow the command's name in parentheses (a name
  # that may itself hold ") "), from the state (field 3) on; the thread count is field
  # 20, the start time field 22. A zombie is one whose every thread has exited: the
  # state is the main thread's, `Z` as soon as it has exited while another thread may
  # still be running the exit and freeing the memory (tens of ms for 256 MiB, and the
  # GPU's with it).
  # (Read by :prim_file, not File: File's reads of a path queue in the one file server
  # process of the node, 56 us a read against 30.)
  defp stat(pid) when is_integer(pid) and pid > 0 do
    with {:ok, stat} <- :prim_file.read_file("/proc/#{pid}/stat"),
         [_ | _] = parens <- :binary.matches(stat, ")"),
         {at, 1} = List.last(parens),
         fields = String.split(binary_part(stat, at + 1, byte_size(stat) - at - 1)),
         [state, ppid, pgrp, session | _] <- fields,
         [threads, _, start | _] <- Enum.drop(fields, 17),
         [{ppid, ""}, {pgrp, ""}, {session, ""}, {threads, ""}, {start, ""}] <-
           Enum.map([ppid, pgrp, session, threads, start], &Integer.parse/1) do
      zombie = state == "Z" and threads <= 1
      {:ok, %{ppid: ppid, pgrp: pgrp, session: session, start: start, zombie: zombie}}
    else
      _ -> :error
    end
  end

  defp stat(_pid), do: :error
end
