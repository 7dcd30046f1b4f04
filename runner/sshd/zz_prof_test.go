package sshd

import (
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime/debug"
	"strings"
	"testing"
	"time"

	"github.com/tandem-run/tandem/runner/account"
)

func TestZZProfFwd(t *testing.T) {
	if os.Getenv("ZZPROF") == "" {
		t.Skip()
	}
	debug.SetGCPercent(400)
	debug.SetMemoryLimit(18 << 20)
	dir := t.TempDir()
	key := filepath.Join(dir, "id")
	exec.Command("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", key).Run()
	pub, _ := os.ReadFile(key + ".pub")
	keys := &KeySet{}
	keys.Add(strings.TrimSpace(string(pub)))
	srv, err := New(Config{HostKeyDir: t.TempDir(), Accounts: account.Accounts{Root: "/"}, Log: slog.New(slog.DiscardHandler)}, keys)
	if err != nil {
		t.Fatal(err)
	}
	ln, _ := net.Listen("tcp", "127.0.0.1:0")
	go func() { _ = srv.Serve(ln) }()
	defer srv.Close()
	sink, _ := net.Listen("tcp", "127.0.0.1:0")
	got := make(chan int64, 10)
	go func() {
		for {
			c, err := sink.Accept()
			if err != nil {
				return
			}
			go func() { n, _ := io.Copy(io.Discard, c); got <- n }()
		}
	}()
	_, port, _ := net.SplitHostPort(ln.Addr().String())
	if p := os.Getenv("ZZPORT"); p != "" {
		port = p
		key = os.Getenv("ZZKEY")
	}
	local := "127.0.0.1:24567"
	cmd := exec.Command("ssh", "-N", "-L", local+":"+sink.Addr().String(), "-p", port, "-i", key, "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null", "-o", "BatchMode=yes", "-c", "aes128-gcm@openssh.com", "root@127.0.0.1")
	cmd.Stderr = os.Stderr
	cmd.Start()
	defer cmd.Process.Kill()
	var c net.Conn
	for i := 0; i < 300; i++ {
		if c, err = net.Dial("tcp", local); err == nil {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	streams := 1
	if os.Getenv("ZZSTREAMS") == "8" {
		streams = 8
	}
	c.Close()
	<-got
	size := 1 << 30
	start := time.Now()
	done := make(chan bool)
	for s := 0; s < streams; s++ {
		go func() {
			c, _ := net.Dial("tcp", local)
			buf := make([]byte, 256<<10)
			for sent := 0; sent < size/streams; sent += len(buf) {
				c.Write(buf)
			}
			c.Close()
			done <- true
		}()
	}
	var n int64
	for s := 0; s < streams; s++ {
		<-done
		n += <-got
	}
	t.Logf("%d bytes %.1f MiB/s", n, float64(n)/time.Since(start).Seconds()/(1<<20))
}
