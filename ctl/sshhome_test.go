package ctl

import (
	"os"
	"path/filepath"
	"slices"
	"testing"
)

// OpenSSH looks for its default keys under the account's home, not $HOME:
// when they differ (sudo -E, a container's HOME), tandem ssh names the key
// tandem run authorized from $HOME (its private file, else its public one
// for the agent to sign with), beside the agent's keys; when they agree,
// ssh finds it itself and nothing is added.
func TestSSHNamesTheHomeKeyWhenHomeIsNotTheAccounts(t *testing.T) {
	home := t.TempDir()
	if err := os.MkdirAll(filepath.Join(home, ".ssh"), 0o700); err != nil {
		t.Fatal(err)
	}
	pub := filepath.Join(home, ".ssh", "id_ed25519.pub")
	priv := filepath.Join(home, ".ssh", "id_ed25519")
	homeIs := func() (string, error) { return home, nil }
	elsewhere := func() string { return "/root" }
	if got := homeIdentity(homeIs, elsewhere); got != "" {
		t.Errorf("no key: %q", got)
	}
	if err := os.WriteFile(pub, []byte("ssh-ed25519 AAAA test\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if got := homeIdentity(homeIs, elsewhere); got != pub {
		t.Errorf("public key only (the agent holds the private one): %q", got)
	}
	if err := os.WriteFile(priv, []byte("private"), 0o600); err != nil {
		t.Fatal(err)
	}
	if got := homeIdentity(homeIs, elsewhere); got != priv {
		t.Errorf("both files: %q", got)
	}
	if got := homeIdentity(homeIs, func() string { return home + "/" }); got != "" {
		t.Errorf("$HOME is the account's home: %q", got)
	}
	opts := SSHEndpoint{Host: "h", Port: 22, User: "root", HomeIdentity: priv}.Options()
	if !slices.Contains(opts, [2]string{"IdentityFile", priv}) || slices.ContainsFunc(opts, func(o [2]string) bool { return o[0] == "IdentitiesOnly" }) {
		t.Errorf("options %q", opts)
	}
	opts = SSHEndpoint{Host: "h", Port: 22, User: "root", Identity: "/k", HomeIdentity: priv}.Options()
	if !slices.Contains(opts, [2]string{"IdentityFile", "/k"}) || slices.Contains(opts, [2]string{"IdentityFile", priv}) {
		t.Errorf("-i given: options %q", opts)
	}
}
