package e2e

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/tandem-run/tandem/e2e/testenv"
)

// fdPassMain is the attacker's two halves (issue 64, hole 2), run as
// helper processes of the test binary:
//
//	send NAME       a job's root in a container on the host network: makes
//	                a TCP socket and hands it, unconnected, over the
//	                abstract unix socket NAME (shared by the host network
//	                namespace) with SCM_RIGHTS;
//	recv NAME ADDR  an ordinary host account: takes the socket, connects
//	                it to ADDR and sends the HTTP request read from stdin,
//	                printing the answer.
func fdPassMain(mode string) int {
	args := strings.Fields(mode)
	fail := func(err error) int { fmt.Fprintln(os.Stderr, "fdpass:", err); return 2 }
	switch {
	case len(args) == 2 && args[0] == "send":
		fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM, 0)
		if err != nil {
			return fail(err)
		}
		c, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: "@" + args[1], Net: "unix"})
		if err != nil {
			return fail(err)
		}
		if _, _, err := c.WriteMsgUnix([]byte("x"), syscall.UnixRights(fd), nil); err != nil {
			return fail(err)
		}
		return 0
	case len(args) == 3 && args[0] == "recv":
		ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: "@" + args[1], Net: "unix"})
		if err != nil {
			return fail(err)
		}
		fmt.Println("ready")
		c, err := ln.AcceptUnix()
		if err != nil {
			return fail(err)
		}
		buf, oob := make([]byte, 1), make([]byte, 64)
		_, oobn, _, _, err := c.ReadMsgUnix(buf, oob)
		if err != nil {
			return fail(err)
		}
		msgs, err := syscall.ParseSocketControlMessage(oob[:oobn])
		if err != nil || len(msgs) != 1 {
			return fail(fmt.Errorf("control message: %v", err))
		}
		fds, err := syscall.ParseUnixRights(&msgs[0])
		if err != nil || len(fds) != 1 {
			return fail(fmt.Errorf("rights: %v", err))
		}
		addr, err := net.ResolveTCPAddr("tcp4", args[2])
		if err != nil {
			return fail(err)
		}
		sa := &syscall.SockaddrInet4{Port: addr.Port}
		copy(sa.Addr[:], addr.IP.To4())
		if err := syscall.Connect(fds[0], sa); err != nil {
			return fail(err)
		}
		conn, err := net.FileConn(os.NewFile(uintptr(fds[0]), "passed"))
		if err != nil {
			return fail(err)
		}
		req, _ := io.ReadAll(os.Stdin)
		_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
		if _, err := conn.Write(req); err != nil {
			return fail(err)
		}
		answer, _ := io.ReadAll(conn)
		os.Stdout.Write(answer)
		return 0
	}
	return fail(fmt.Errorf("unknown mode %q", mode))
}

// TestPassedSocketIsJudgedByItsHolder (issue 64, hole 2): on the build
// before the fix, a socket made by a job's root (uid 0 in its container,
// on the host network) and connected by an ordinary account that received
// it got 200 and a task mounting a root-only directory. Every process
// holding the socket counts now: the account's uid is refused (403, no
// task), while root's own connection still drives the shim.
func TestPassedSocketIsJudgedByItsHolder(t *testing.T) {
	testenv.RequireDocker(t)
	if os.Geteuid() != 0 {
		t.Skip("needs root (another uid, another mount namespace)")
	}
	h := startShim(t, testenv.Binaries(t).Runner, nil)
	secret := t.TempDir()
	body := `{"id":"` + randomID("t") + `","name":"steal","image_name":"` + h.image + `","container_user":"root","network_mode":"host",` +
		`"instance_mounts":[{"instance_path":"` + secret + `","path":"/secret"}]}`
	req := "POST /api/tasks HTTP/1.1\r\nHost: " + h.addr() + "\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: " +
		fmt.Sprint(len(body)) + "\r\n\r\n" + body
	name := randomID("tandem-fdpass")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	// The test binary, where another account may run it (go test's build
	// dir is root's alone).
	dir := t.TempDir()
	self := filepath.Join(dir, "fdpass")
	if b, err := os.ReadFile(os.Args[0]); err != nil || os.WriteFile(self, b, 0o755) != nil || os.Chmod(dir, 0o755) != nil || os.Chmod(filepath.Dir(dir), 0o755) != nil {
		t.Fatalf("copy the test binary: %v", err)
	}
	recv := exec.CommandContext(ctx, self)
	recv.Env = append(os.Environ(), "TANDEM_E2E_FDPASS=recv "+name+" "+h.addr())
	recv.Stdin = strings.NewReader(req)
	recv.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	out, err := recv.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr strings.Builder
	recv.Stderr = &stderr
	if err := recv.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = syscall.Kill(-recv.Process.Pid, syscall.SIGKILL) })
	rd := bufio.NewReader(out)
	if line, err := rd.ReadString('\n'); err != nil || line != "ready\n" {
		t.Fatalf("receiver: %q %v %s", line, err, stderr.String())
	}
	// The job's side: root, in a mount namespace of its own (a container's
	// view), on the host's network.
	send := exec.CommandContext(ctx, "unshare", "--mount", "--", self)
	send.Env = append(os.Environ(), "TANDEM_E2E_FDPASS=send "+name)
	send.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if b, err := send.CombinedOutput(); err != nil {
		t.Fatalf("sender: %v %s", err, b)
	}
	answer, _ := io.ReadAll(rd)
	_ = recv.Wait()
	if !strings.Contains(string(answer), "403") || !strings.Contains(string(answer), "uid 65534") {
		t.Fatalf("the passed socket was not refused as nobody's: %q (receiver: %s)", answer, stderr.String())
	}
	if items, err := h.client.ListTasks(context.Background()); err != nil || len(items) != 0 {
		t.Fatalf("root's own connection: tasks %+v, %v (the refused submit must leave none)", items, err)
	}
}
