package ctl

import (
	"bytes"
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/user"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/tandem-run/tandem/common/deadlineconn"
	"golang.org/x/crypto/ssh"
	"golang.org/x/crypto/ssh/knownhosts"
)

// Tunnel is an SSH connection whose Dial opens connections from the far end.
type Tunnel struct{ client *ssh.Client }

// Dial connects to addr as seen from the SSH host. SSH channels have no
// deadlines; the returned conn emulates them by closing the channel when a
// deadline passes, so libraries that bound a handshake with one still work.
func (t *Tunnel) Dial(ctx context.Context, network, addr string) (net.Conn, error) {
	c, err := t.client.DialContext(ctx, network, addr)
	if err != nil {
		return nil, err
	}
	return deadlineconn.Wrap(c), nil
}

// Close ends the SSH connection.
func (t *Tunnel) Close() error { return t.client.Close() }

// DialSSH logs in to the target, checking its host key against known_hosts.
func DialSSH(ctx context.Context, s SSHTarget) (*Tunnel, error) {
	login, hostport, ok := strings.Cut(s.Target, "@")
	if !ok {
		u, err := user.Current()
		if err != nil {
			return nil, fmt.Errorf("ssh target %q: no user given", s.Target)
		}
		login, hostport = u.Username, s.Target
	}
	if _, _, err := net.SplitHostPort(hostport); err != nil {
		hostport = net.JoinHostPort(hostport, "22")
	}
	home, _ := os.UserHomeDir()
	keyFiles := []string{s.Identity}
	if s.Identity == "" {
		keyFiles = []string{filepath.Join(home, ".ssh", "id_ed25519"), filepath.Join(home, ".ssh", "id_rsa")}
	}
	var signer ssh.Signer
	var keyErr error
	for _, kf := range keyFiles {
		b, err := os.ReadFile(kf)
		if err != nil {
			keyErr = err
			continue
		}
		if signer, keyErr = ssh.ParsePrivateKey(b); keyErr == nil {
			break
		}
		keyErr = fmt.Errorf("%s: %w", kf, keyErr)
	}
	if signer == nil {
		return nil, fmt.Errorf("no usable SSH key (give one with -i): %w", keyErr)
	}
	kh := s.KnownHosts
	if kh == "" {
		kh = filepath.Join(home, ".ssh", "known_hosts")
	}
	check, err := knownhosts.New(kh)
	if err != nil {
		return nil, fmt.Errorf("known hosts %s: %w (connect once with ssh to record the host key)", kh, err)
	}
	var d net.Dialer
	conn, err := d.DialContext(ctx, "tcp", hostport)
	if err != nil {
		return nil, fmt.Errorf("ssh %s: %w", hostport, err)
	}
	// As OpenSSH: offer first the key algorithms on file for this host,
	// so the server shows the key we know; a host with keys of several
	// types is not a mismatch because its first offer is another type.
	onFile := knownKeys(check, hostport, conn.RemoteAddr())
	var presented ssh.PublicKey
	cfg := &ssh.ClientConfig{
		User: login,
		Auth: []ssh.AuthMethod{ssh.PublicKeys(signer)},
		HostKeyCallback: func(host string, remote net.Addr, key ssh.PublicKey) error {
			presented = key
			return check(host, remote, key)
		},
		HostKeyAlgorithms: hostKeyAlgorithms(onFile),
		Timeout:           15 * time.Second,
	}
	c, chans, reqs, err := ssh.NewClientConn(conn, hostport, cfg)
	if err != nil {
		conn.Close()
		var kerr *knownhosts.KeyError
		if errors.As(err, &kerr) {
			return nil, hostKeyError(hostport, kh, presented, kerr)
		}
		if len(onFile) > 0 && strings.Contains(err.Error(), "no common algorithm for host key") {
			// None of the key types on file: the host changed its keys.
			return nil, hostKeyError(hostport, kh, nil, &knownhosts.KeyError{Want: onFile})
		}
		return nil, fmt.Errorf("ssh %s as %s: %w", hostport, login, err)
	}
	return &Tunnel{client: ssh.NewClient(c, chans, reqs)}, nil
}

// knownKeys returns the keys known_hosts holds for host (by name and by
// address): asked about a key it cannot hold, the checker lists them.
func knownKeys(check ssh.HostKeyCallback, host string, remote net.Addr) []knownhosts.KnownKey {
	pub, _, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		return nil
	}
	probe, err := ssh.NewPublicKey(pub)
	if err != nil {
		return nil
	}
	var kerr *knownhosts.KeyError
	if errors.As(check(host, remote, probe), &kerr) {
		return kerr.Want
	}
	return nil
}

// hostKeyAlgorithms are the algorithms for the key types on file, in file
// order (RSA keys by their SHA-2 signatures first); nil: the library's
// defaults (nothing on file: the key is unknown whatever its type).
func hostKeyAlgorithms(keys []knownhosts.KnownKey) []string {
	var algos []string
	add := func(a ...string) {
		for _, x := range a {
			if !slices.Contains(algos, x) {
				algos = append(algos, x)
			}
		}
	}
	for _, k := range keys {
		switch t := k.Key.Type(); t {
		case ssh.KeyAlgoRSA:
			add(ssh.KeyAlgoRSASHA512, ssh.KeyAlgoRSASHA256, ssh.KeyAlgoRSA)
		case ssh.CertAlgoRSAv01:
			add(ssh.CertAlgoRSASHA512v01, ssh.CertAlgoRSASHA256v01, ssh.CertAlgoRSAv01)
		default:
			add(t)
		}
	}
	return algos
}

// hostKeyError says what is wrong with the host key and what to do.
func hostKeyError(host, file string, presented ssh.PublicKey, kerr *knownhosts.KeyError) error {
	got := "the server's key"
	if presented != nil {
		got = presented.Type() + " " + ssh.FingerprintSHA256(presented)
	}
	if len(kerr.Want) == 0 {
		return fmt.Errorf("ssh %s: host key %s is not in %s; check it with the host's owner, then connect once with ssh to record it", host, got, file)
	}
	var want []string
	for _, k := range kerr.Want {
		want = append(want, fmt.Sprintf("%s %s (%s:%d)", k.Key.Type(), ssh.FingerprintSHA256(k.Key), k.Filename, k.Line))
	}
	return fmt.Errorf("ssh %s: HOST KEY MISMATCH: the server sent %s, %s holds %s; someone may be intercepting the connection, refusing to connect. If the host was reinstalled, remove the old key with: ssh-keygen -R '%s' -f %s",
		host, got, file, strings.Join(want, ", "), knownhosts.Normalize(host), file)
}

// Run runs cmd on the SSH host (through its login shell) with stdin, and
// returns its stdout and stderr; an exit status other than 0 is an error
// carrying stderr. ctx ends the session.
func (t *Tunnel) Run(ctx context.Context, cmd string, stdin io.Reader) (stdout, stderr []byte, err error) {
	s, err := t.client.NewSession()
	if err != nil {
		return nil, nil, fmt.Errorf("ssh session: %w", err)
	}
	defer s.Close()
	var out, errb bytes.Buffer
	s.Stdin, s.Stdout, s.Stderr = stdin, &out, &errb
	done := make(chan error, 1)
	go func() { done <- s.Run(cmd) }()
	select {
	case err = <-done:
	case <-ctx.Done():
		s.Close()
		return out.Bytes(), errb.Bytes(), ctx.Err()
	}
	if err != nil {
		msg := strings.TrimSpace(errb.String())
		if msg == "" {
			msg = strings.TrimSpace(out.String())
		}
		return out.Bytes(), errb.Bytes(), fmt.Errorf("%w: %s", err, msg)
	}
	return out.Bytes(), errb.Bytes(), nil
}
