package procs

import (
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"
)

// The child's side of TestPrioritize: it prioritizes itself, makes more
// threads, and prints the result and every thread's nice value.
func init() {
	want := os.Getenv("TANDEM_PROCS_NICE_CHILD")
	if want == "" {
		return
	}
	n, _ := strconv.Atoi(want)
	now, err := Prioritize(n)
	started := make(chan struct{})
	for range 4 { // threads made after: they inherit the value
		go func() {
			runtime.LockOSThread()
			started <- struct{}{}
			select {}
		}()
		<-started
	}
	var nices []string
	entries, _ := os.ReadDir("/proc/self/task")
	for _, e := range entries {
		v, terr := threadNice(filepath.Join("/proc/self/task", e.Name()))
		if terr != nil {
			continue
		}
		nices = append(nices, strconv.Itoa(v))
	}
	os.Stdout.WriteString(strconv.Itoa(now) + " " + strconv.FormatBool(err == nil) + " " + strings.Join(nices, ",") + "\n")
	os.Exit(0)
}

func TestPrioritize(t *testing.T) {
	if os.Geteuid() != 0 {
		if os.Getenv("CI") == "true" {
			t.Fatal("a nice below 0 needs root (CI runs as root)")
		}
		t.Skip("a nice below 0 needs root")
	}
	run := func(t *testing.T, prefix []string, want string) (now string, ok bool, nices []string) {
		t.Helper()
		argv := append(prefix, os.Args[0], "-test.run", "^$")
		cmd := exec.Command(argv[0], argv[1:]...)
		cmd.Env = append(os.Environ(), "TANDEM_PROCS_NICE_CHILD="+want)
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("%v: %v", argv, err)
		}
		f := strings.Fields(string(out))
		if len(f) != 3 {
			t.Fatalf("child said %q", out)
		}
		return f[0], f[1] == "true", strings.Split(f[2], ",")
	}
	t.Run("every thread, and those made after", func(t *testing.T) {
		now, ok, nices := run(t, nil, "-5")
		if now != "-5" || !ok {
			t.Fatalf("Prioritize(-5) = %s, ok %v", now, ok)
		}
		if len(nices) < 5 {
			t.Fatalf("only %d threads seen", len(nices))
		}
		for i, v := range nices {
			if v != "-5" {
				t.Errorf("thread %d of %d at nice %s, want -5", i, len(nices), v)
			}
		}
	})
	t.Run("an operator's nice stands", func(t *testing.T) {
		now, ok, nices := run(t, []string{"nice", "-n", "3"}, "-5")
		if now != "3" || !ok {
			t.Fatalf("started at nice 3: Prioritize(-5) = %s, ok %v; want 3 kept", now, ok)
		}
		for i, v := range nices {
			if v != "3" {
				t.Errorf("thread %d at nice %s, want the operator's 3", i, v)
			}
		}
	})
	t.Run("0 leaves it", func(t *testing.T) {
		now, ok, nices := run(t, nil, "0")
		if now != "0" || !ok {
			t.Fatalf("Prioritize(0) = %s, ok %v", now, ok)
		}
		for _, v := range nices {
			if v != "0" {
				t.Errorf("a thread at nice %s", v)
			}
		}
	})
}

func TestThreadNice(t *testing.T) {
	dir := t.TempDir()
	// A command name with spaces and a parenthesis, as a hostile one may be.
	stat := "42 (a) b (c) S 1 42 42 0 -1 4194560 100 0 0 0 1 2 0 0 20 -7 1 0 100 1000 200\n"
	if err := os.WriteFile(filepath.Join(dir, "stat"), []byte(stat), 0o644); err != nil {
		t.Fatal(err)
	}
	if n, err := threadNice(dir); err != nil || n != -7 {
		t.Fatalf("threadNice = %d, %v; want -7", n, err)
	}
	if err := os.WriteFile(filepath.Join(dir, "stat"), []byte("42 (x) S 1"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := threadNice(dir); err == nil {
		t.Fatal("a short stat line read as a nice value")
	}
	if err := os.WriteFile(filepath.Join(dir, "stat"), []byte("42 x S 1 42 42 0 -1 4194560 100 0 0 0 1 2 0 0 20 -7 1 0"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := StatFields(dir); err == nil {
		t.Fatal("a stat line without a command name in parentheses was read")
	}
}
