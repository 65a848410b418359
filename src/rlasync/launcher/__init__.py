"""Starting a run on many machines: ``rlasync launch --nodes hosts.txt`` (``Launch``), torchrun
and Slurm starts (``--from-env``: ``launcher.environment``), and ``rlasync status``."""

from .environment import Launched, LaunchEnvError, from_env
from .hosts import Host, HostsFileError, parse_hosts, read_hosts
from .supervisor import Launch, LaunchError, remote_command

__all__ = [
    "Host",
    "HostsFileError",
    "Launch",
    "LaunchEnvError",
    "LaunchError",
    "Launched",
    "from_env",
    "parse_hosts",
    "read_hosts",
    "remote_command",
]
