"""The TCP sockets a process tree listens on, read from /proc (Linux): ``/proc/PID/fd`` names each socket's inode,
``/proc/PID/net/tcp`` and ``tcp6`` give the address of each listening one."""
from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
from pathlib import Path

LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's st column


def tree(pid: int) -> list[int]:
    """``pid`` and its descendants (those alive now)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def socket_inodes(pid: int) -> set[str]:
    out = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            out.add(link[8:-1])
    return out


def _address(hex_addr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """/proc/net/tcp's address column: 32-bit words in host (little-endian) order."""
    raw = bytes.fromhex(hex_addr)
    return ipaddress.ip_address(b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)))


def listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket process ``pid`` holds in the listening state."""
    inodes, out = socket_inodes(pid), []
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if cols[3] == LISTEN and cols[9] in inodes:
                addr, port = cols[1].split(":")
                out.append((str(_address(addr)), int(port, 16)))
    return out


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def exposed(pid: int) -> dict[int, list[tuple[str, int]]]:
    """pid -> its listening sockets off loopback, over the process tree of ``pid`` (empty: nothing exposed)."""
    out = {}
    for p in tree(pid):
        bad = [(a, port) for a, port in listening(p) if not is_loopback(a)]
        if bad:
            out[p] = bad
    return out


def outside_interfaces() -> list[str]:
    """The network interfaces with an IPv4 address off loopback (SIOCGIFADDR)."""
    out = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
            except OSError:
                continue
            if not ipaddress.ip_address(raw[20:24]).is_loopback:
                out.append(name)
    return out
