// SPDX-License-Identifier: GPL-2.0
/*
 * gf_sites: a tiny HTTP server with two call sites of one library function,
 * for `gpufault explore` (tests/test_explore*.py). Each completion request
 * calls gf_alloc() in libgftarget.so twice, from two functions:
 *
 *   cache_lookup()  a failure is a cache miss: the request still answers 200
 *   compute()       a failure fails the request: 500
 *
 * so failing one site is tolerated and failing the other breaks the SLO.
 * Usage: gf_sites [PORT]   (0 or none: any free port). One line on stderr
 * once it listens: "serving on http://127.0.0.1:PORT".
 *   GET  /health           {"status": "ok"}
 *   POST /v1/completions   {"text": "...", "cache": "hit"|"miss"} or 500
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

int gf_alloc(uint64_t *dptr, uint64_t size);

/* A failed allocation here is a cache miss: the answer is computed anyway. */
__attribute__((noinline)) static int cache_lookup(void)
{
	uint64_t p = 0;

	return gf_alloc(&p, 64) == 0;
}

/* A failed allocation here fails the request. */
__attribute__((noinline)) static int compute(void)
{
	uint64_t p = 0;

	return gf_alloc(&p, 4096);
}

static void reply(int fd, int status, const char *body)
{
	char head[256];
	int n = snprintf(head, sizeof(head),
			 "HTTP/1.1 %d %s\r\nContent-Type: application/json\r\n"
			 "Content-Length: %zu\r\nConnection: close\r\n\r\n",
			 status, status == 200 ? "OK" : status == 404 ? "Not Found" : "Error",
			 strlen(body));
	/* MSG_NOSIGNAL: a client that gave up (its timeout) costs this answer,
	 * not the process (a write() would raise SIGPIPE). */
	if (send(fd, head, n, MSG_NOSIGNAL) < 0 || send(fd, body, strlen(body), MSG_NOSIGNAL) < 0)
		return;
}

static void *serve(void *arg)
{
	int fd = (int)(intptr_t)arg;
	char buf[8192];
	size_t got = 0;
	char *end = NULL;

	/* Read the head, then as much of the body as Content-Length says. */
	while (got < sizeof(buf) - 1 && !end) {
		ssize_t r = read(fd, buf + got, sizeof(buf) - 1 - got);
		if (r <= 0)
			goto out;
		got += r;
		buf[got] = 0;
		end = strstr(buf, "\r\n\r\n");
	}
	if (!end)
		goto out;
	char *cl = strcasestr(buf, "content-length:");
	size_t want = cl ? strtoul(cl + 15, NULL, 10) : 0;
	while (got - (end + 4 - buf) < want && got < sizeof(buf) - 1) {
		ssize_t r = read(fd, buf + got, sizeof(buf) - 1 - got);
		if (r <= 0)
			break;
		got += r;
	}
	if (!strncmp(buf, "GET /health", 11)) {
		reply(fd, 200, "{\"status\": \"ok\"}");
	} else if (!strncmp(buf, "POST /v1/completions", 20)) {
		int hit = cache_lookup();
		if (compute() != 0)
			reply(fd, 500, "{\"error\": \"compute failed\"}");
		else
			reply(fd, 200, hit ? "{\"text\": \"ok\", \"cache\": \"hit\"}"
					   : "{\"text\": \"ok\", \"cache\": \"miss\"}");
	} else {
		reply(fd, 404, "{\"error\": \"no such path\"}");
	}
out:
	close(fd);
	return NULL;
}

int main(int argc, char **argv)
{
	struct sockaddr_in a = { .sin_family = AF_INET };
	socklen_t len = sizeof(a);
	int one = 1;
	int s = socket(AF_INET, SOCK_STREAM, 0);

	a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	a.sin_port = htons(argc > 1 ? atoi(argv[1]) : 0);
	setsockopt(s, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
	if (s < 0 || bind(s, (struct sockaddr *)&a, sizeof(a)) || listen(s, 128) ||
	    getsockname(s, (struct sockaddr *)&a, &len)) {
		perror("gf_sites");
		return 1;
	}
	fprintf(stderr, "serving on http://127.0.0.1:%d\n", ntohs(a.sin_port));
	fflush(stderr);
	for (;;) {
		int c = accept(s, NULL, NULL);
		pthread_t t;

		if (c < 0)
			continue;
		if (pthread_create(&t, NULL, serve, (void *)(intptr_t)c)) {
			close(c);
			continue;
		}
		pthread_detach(t);
	}
}
