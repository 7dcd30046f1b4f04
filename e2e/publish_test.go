package e2e

import (
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/tandem-run/tandem/e2e/testenv"
)

// TestTandemPublish (issue 67): tandem run -p HOST_IP:HOST_PORT:PORT
// publishes a job's port on the host, as docker run -p, on the bridge
// network (the default); rm takes the port back. -p on the host network
// is refused before anything is made, with what to do.
func TestTandemPublish(t *testing.T) {
	h, shim, _ := realStack(t)
	dir := t.TempDir()
	port := testenv.FreePort(t)
	url := "http://127.0.0.1:" + strconv.Itoa(port) + "/"
	run, out, errb := tandemIn(t, dir, nil, "run", "-d", "--shim", shim, "--name", "web",
		"-p", "127.0.0.1:"+strconv.Itoa(port)+":8080", "-p", "9090/udp", h.image,
		"sh", "-c", "mkdir -p /w && echo published-by-tandem > /w/index.html && exec httpd -f -p 8080 -h /w")
	if err := run.Run(); err != nil {
		t.Fatalf("run -d -p: %v\n%s\n%s", err, out, errb)
	}
	t.Cleanup(func() { rm, _, _ := tandemIn(t, dir, nil, "rm", "-f", "--shim", shim, "web"); _ = rm.Run() })
	client := &http.Client{Timeout: 2 * time.Second}
	deadline := time.Now().Add(60 * time.Second)
	var body string
	for {
		if resp, err := client.Get(url); err == nil {
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if body = string(b); strings.Contains(body, "published-by-tandem") {
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("the job's port 8080 never answered on %s (last body %q)", url, body)
		}
		time.Sleep(200 * time.Millisecond)
	}
	// Where the ports are, as docker ps and docker port say it; the one
	// given no host port got one Docker picked.
	bound := "127.0.0.1:" + strconv.Itoa(port)
	ps, psOut, psErr := tandemIn(t, dir, nil, "ps", "--shim", shim)
	if err := ps.Run(); err != nil || !strings.Contains(psOut.String(), "PORTS") || !strings.Contains(psOut.String(), bound+"->8080/tcp") || !strings.Contains(psOut.String(), "->9090/udp") {
		t.Fatalf("ps has no PORTS of web: %v\n%s\n%s", err, psOut, psErr)
	}
	pc, pcOut, pcErr := tandemIn(t, dir, nil, "port", "--shim", shim, "web")
	if err := pc.Run(); err != nil || !strings.Contains(pcOut.String(), "8080/tcp -> "+bound+"\n") || !strings.Contains(pcOut.String(), "9090/udp -> ") {
		t.Fatalf("tandem port web: %v\n%s\n%s", err, pcOut, pcErr)
	}
	pc, pcOut, pcErr = tandemIn(t, dir, nil, "port", "--shim", shim, "web", "9090/udp")
	if err := pc.Run(); err != nil {
		t.Fatalf("tandem port web 9090/udp: %v\n%s", err, pcErr)
	}
	for _, l := range strings.Fields(pcOut.String()) {
		if _, p, err := net.SplitHostPort(l); err != nil || p == "0" {
			t.Fatalf("tandem port web 9090/udp: %q is not the host port Docker picked", pcOut)
		}
	}
	pc, _, pcErr = tandemIn(t, dir, nil, "port", "--shim", shim, "web", "81")
	if err := pc.Run(); exitCodeOf(err) != 125 || !strings.Contains(pcErr.String(), "no public port '81/tcp' published for web") {
		t.Fatalf("tandem port web 81: exit %d, stderr %q", exitCodeOf(err), pcErr)
	}
	rm, rmOut, rmErr := tandemIn(t, dir, nil, "rm", "-f", "--shim", shim, "web")
	if err := rm.Run(); err != nil {
		t.Fatalf("rm -f web: %v\n%s\n%s", err, rmOut, rmErr)
	}
	deadline = time.Now().Add(30 * time.Second)
	for {
		c, err := net.DialTimeout("tcp", "127.0.0.1:"+strconv.Itoa(port), time.Second)
		if err != nil {
			break
		}
		c.Close()
		if time.Now().After(deadline) {
			t.Fatalf("port %d still open after rm -f", port)
		}
		time.Sleep(200 * time.Millisecond)
	}

	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--network", "host", "-p", "8080:80"}, "--publish needs the bridge network, as a host-network job's ports are the host's already: drop --network host"},
		{[]string{"-p", "8000-8010:80"}, `--publish "8000-8010:80": the host port "8000-8010" is a range: give each port with its own -p`},
		{[]string{"-P"}, "tandem run has no -P (docker's): tandem publishes only the ports you name: give each with -p HOST_PORT:CONTAINER_PORT"},
	} {
		args := append(append([]string{"run", "--shim", shim, "--name", "refused"}, tc.args...), h.image, "true")
		cmd, out, errb := tandemIn(t, dir, nil, args...)
		err := cmd.Run()
		if code := exitCodeOf(err); code == 0 || !strings.Contains(errb.String(), tc.want) {
			t.Errorf("tandem %s: exit %d, stderr %q; want a refusal saying %q", strings.Join(args, " "), code, errb, tc.want)
		}
		_ = out
	}
	ps, psOut, _ = tandemIn(t, dir, nil, "ps", "-a", "--shim", shim)
	if err := ps.Run(); err != nil || strings.Contains(psOut.String(), "refused") {
		t.Fatalf("a refused run left a task: %v\n%s", err, psOut)
	}
}
