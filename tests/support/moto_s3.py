"""A moto S3 server in its own process, spoken to over HTTP, with credential checks switched on.

moto accepts any credentials by default; a store test that passes with wrong keys proves nothing. After start-up we
create an IAM user with full access through the server's own IAM API, then turn authentication on (moto's
`/moto-api/reset-auth`), so from then on only that user's keys work.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import urllib.request

import boto3
from botocore.config import Config

from jobs.ports import free_port
from jobs.store import StoreCredentials
from tests.support.net import wait_http

_ADMIN_POLICY = json.dumps(
    {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}
)


class MotoS3Server:
    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None
        self.credentials: StoreCredentials | None = None

    def start(self) -> MotoS3Server:
        env = {**os.environ, "MOTO_ALLOW_NONEXISTENT_REGION": "true"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        wait_http(self.url + "/moto-api/")
        iam = boto3.client(
            "iam",
            endpoint_url=self.url,
            region_name="us-east-1",
            aws_access_key_id="bootstrap",
            aws_secret_access_key="bootstrap",
        )
        iam.create_user(UserName="panel")
        iam.put_user_policy(UserName="panel", PolicyName="all", PolicyDocument=_ADMIN_POLICY)
        key = iam.create_access_key(UserName="panel")["AccessKey"]
        self.credentials = StoreCredentials(key["AccessKeyId"], key["SecretAccessKey"])
        request = urllib.request.Request(
            self.url + "/moto-api/reset-auth", data=b"0", method="POST", headers={"Content-Type": "text/plain"}
        )
        urllib.request.urlopen(request, timeout=10).close()
        return self

    def client(self):
        return boto3.client(
            "s3",
            endpoint_url=self.url,
            region_name="us-east-1",
            aws_access_key_id=self.credentials.access_key_id,
            aws_secret_access_key=self.credentials.secret_access_key,
            config=Config(s3={"addressing_style": "path"}),
        )

    def create_bucket(self, name: str | None = None) -> str:
        name = name or f"test-{secrets.token_hex(6)}"
        self.client().create_bucket(Bucket=name)
        return name

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            self.process = None
