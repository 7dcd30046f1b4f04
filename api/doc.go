// Package api is Tandem's one wire contract: the request and response types of
// dstack-shim's and dstack-runner's HTTP APIs, and the enums both sides share.
//
// The shapes follow what dstack's agents really put on the wire, quirks included
// (the `gpus_ids` key, `ports` null before start and [] in host mode, base64 log
// messages, the submit response serialized with Go field names). Decoding is
// lenient the way dstack's server relies on: unknown fields are ignored and JSON
// null leaves optional fields at their zero value. Golden files in testdata/ pin
// every shape.
package api
