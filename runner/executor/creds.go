package executor

import (
	"errors"
	"fmt"
	"net/url"
	"os"
	"path/filepath"

	"github.com/tandem-run/tandem/api"
)

// writeGitCredentials puts the repo credentials where git and gh look for
// them in the job user's home (runner-protocol.md 7.3) and returns a cleanup
// that removes exactly what it wrote.
func writeGitCredentials(c *api.RepoCredentials, user JobUser, chown bool) (func(), error) {
	noop := func() {}
	if c == nil || c.CloneURL == "" || !user.ProvisionHome {
		return noop, nil
	}
	u, err := url.Parse(c.CloneURL)
	if err != nil {
		return noop, fmt.Errorf("clone url: %w", err)
	}
	own := func(p string) {
		if chown {
			_ = os.Lchown(p, user.UID, user.GID)
		}
	}
	var path string
	var data []byte
	switch u.Scheme {
	case "ssh":
		if c.PrivateKey == "" {
			return noop, errors.New("ssh clone url without a private key")
		}
		path, data = filepath.Join(user.Home, ".ssh", "id_rsa"), []byte(c.PrivateKey)
	case "https":
		if c.OAuthToken == "" {
			return noop, nil
		}
		path = filepath.Join(user.Home, ".config", "gh", "hosts.yml")
		data = []byte(fmt.Sprintf("%s:\n    oauth_token: %q\n", u.Hostname(), c.OAuthToken))
	default:
		return noop, fmt.Errorf("unsupported clone url scheme %q", u.Scheme)
	}
	if _, err := os.Lstat(path); err == nil {
		return noop, fmt.Errorf("%s already exists", path)
	}
	for _, d := range []string{filepath.Dir(filepath.Dir(path)), filepath.Dir(path)} {
		if _, err := os.Stat(d); os.IsNotExist(err) {
			if err := os.Mkdir(d, 0o700); err != nil {
				return noop, err
			}
			own(d)
		}
	}
	if err := os.WriteFile(path, data, 0o600); err != nil {
		return noop, err
	}
	own(path)
	return func() { _ = os.Remove(path) }, nil
}
