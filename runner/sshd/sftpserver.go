package sshd

import (
	"errors"
	"io"
	"os"

	"github.com/pkg/sftp"
)

type stdio struct{}

func (stdio) Read(p []byte) (int, error)  { return os.Stdin.Read(p) }
func (stdio) Write(p []byte) (int, error) { return os.Stdout.Write(p) }
func (stdio) Close() error {
	return errors.Join(os.Stdin.Close(), os.Stdout.Close())
}

// ServeSFTP serves sftp on stdin/stdout until the client leaves; it runs in
// the child the server starts as the login user.
func ServeSFTP() error {
	wd, _ := os.Getwd()
	srv, err := sftp.NewServer(stdio{}, sftp.WithServerWorkingDirectory(wd))
	if err != nil {
		return err
	}
	if err := srv.Serve(); err != nil && !errors.Is(err, io.EOF) {
		return err
	}
	return nil
}
