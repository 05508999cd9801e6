package main

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"runtime"
	"strconv"
	"strings"
	"time"
)

// Linux accounting from /proc: the CPU time of the machine and of the
// processes that matter (this one, PostgreSQL's, MariaDB's, RabbitMQ's) around each
// timed section, and a process's peak RSS.

const clockTick = 100 // USER_HZ, 100 on every Linux this runs on

type cpuSnap struct {
	busy, total int64            // machine, in ticks summed over CPUs
	procs       map[int]procTime // pid -> times
}

type procTime struct {
	kind  string // "harness", "postgres", "mariadb", "rabbitmq"
	ticks int64
}

func readCPU() cpuSnap {
	s := cpuSnap{procs: map[int]procTime{}}
	if b, err := os.ReadFile("/proc/stat"); err == nil {
		first, _, _ := strings.Cut(string(b), "\n")
		f := strings.Fields(first)
		for i, v := range f[1:] {
			n, _ := strconv.ParseInt(v, 10, 64)
			if i >= 8 { // guest time is already in user
				break
			}
			s.total += n
			if i != 3 && i != 4 { // idle, iowait
				s.busy += n
			}
		}
	}
	self := os.Getpid()
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile("/proc/" + e.Name() + "/stat")
		if err != nil {
			continue
		}
		open, close := strings.IndexByte(string(b), '('), strings.LastIndexByte(string(b), ')')
		if open < 0 || close < open {
			continue
		}
		comm := string(b[open+1 : close])
		var kind string
		switch {
		case pid == self:
			kind = "harness"
		case comm == "postgres" || strings.HasPrefix(comm, "postgres"):
			kind = "postgres"
		case comm == "mariadbd" || comm == "mysqld":
			kind = "mariadb"
		case comm == "beam.smp" || strings.HasPrefix(comm, "erl_") || comm == "epmd":
			kind = "rabbitmq"
		default:
			continue
		}
		f := strings.Fields(string(b[close+1:]))
		if len(f) < 13 {
			continue
		}
		ut, _ := strconv.ParseInt(f[11], 10, 64)
		st, _ := strconv.ParseInt(f[12], 10, 64)
		s.procs[pid] = procTime{kind: kind, ticks: ut + st}
	}
	return s
}

// cpuAccount sums the timed sections of one variant.
type cpuAccount struct {
	id          string
	sections    int
	items       int
	wall        time.Duration
	busy, total int64
	byKind      map[string]int64
}

func (a *cpuAccount) add(before, after cpuSnap, items int, wall time.Duration) {
	if a.byKind == nil {
		a.byKind = map[string]int64{}
	}
	a.sections++
	a.items += items
	a.wall += wall
	a.busy += after.busy - before.busy
	a.total += after.total - before.total
	for pid, p := range after.procs {
		d := p.ticks - before.procs[pid].ticks // a process born meanwhile counts whole
		if d > 0 {
			a.byKind[p.kind] += d
		}
	}
}

// printCPU writes where the CPU went during each variant's timed sections,
// as a share of the machine's capacity (all CPUs), and per item.
func (h *harness) printCPU(w io.Writer) {
	fmt.Fprintf(w, "CPU during the timed sections (%% of the machine's %d CPUs; /proc; PostgreSQL, MariaDB and RabbitMQ include any other client's work):\n\n", runtime.NumCPU())
	fmt.Fprintln(w, "| variant | timed | items/s | machine busy | this process | PostgreSQL | MariaDB | RabbitMQ | other | CPU µs/item: this / PG / MariaDB / RabbitMQ |")
	fmt.Fprintln(w, "|---|---|---|---|---|---|---|---|---|---|")
	for _, a := range h.cpu {
		if a.total == 0 || a.items == 0 {
			continue
		}
		pct := func(t int64) string { return fmt.Sprintf("%.0f%%", 100*float64(t)/float64(a.total)) }
		perItem := func(t int64) string {
			return strconv.FormatFloat(float64(t)/clockTick*1e6/float64(a.items), 'f', 0, 64)
		}
		other := a.busy - a.byKind["harness"] - a.byKind["postgres"] - a.byKind["mariadb"] - a.byKind["rabbitmq"]
		fmt.Fprintf(w, "| %s | %d × %s | %s | %s | %s | %s | %s | %s | %s | %s / %s / %s / %s |\n",
			a.id, a.sections, (a.wall / time.Duration(a.sections)).Round(10*time.Millisecond), thousands(int64(float64(a.items)/a.wall.Seconds())),
			pct(a.busy), pct(a.byKind["harness"]), pct(a.byKind["postgres"]), pct(a.byKind["mariadb"]), pct(a.byKind["rabbitmq"]), pct(max(other, 0)),
			perItem(a.byKind["harness"]), perItem(a.byKind["postgres"]), perItem(a.byKind["mariadb"]), perItem(a.byKind["rabbitmq"]))
	}
}

// vmHWM is the peak resident set size of pid in MiB (VmHWM of
// /proc/<pid>/status).
func vmHWM(pid int) (float64, error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, err
	}
	defer func() { _ = f.Close() }()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), "VmHWM:"); ok {
			fs := strings.Fields(rest)
			kb, err := strconv.ParseFloat(fs[0], 64)
			if err != nil {
				return 0, err
			}
			return kb / 1024, nil
		}
	}
	return 0, fmt.Errorf("no VmHWM in /proc/%d/status", pid)
}
